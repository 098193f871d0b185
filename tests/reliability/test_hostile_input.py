"""Hostile or broken input (issue 14, item 7), beyond the msgpack decoder's fuzzing in
tests/test_wire.py: every JSONL reader takes any line and either yields a summary or raises the
one-line BadData (no other exception escapes), and a summary or heartbeat written into another
job's stream is rejected and counted, not judged as that job's."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from argus import reader, wire
from argus.aggregator.engine import JsonlSource
from argus.errors import BadData
from argus.rediskeys import k_hb, k_steps
from argus.replay import load_jsonl
from argus.schema import Heartbeat
from tests.helpers import REPO_ROOT
from tests.test_transport import steps

RECORDED = (REPO_ROOT / "tests" / "data" / "probe-default-dp4.jsonl").read_text().splitlines()[0]

json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


@st.composite
def mutated_summary(draw: Any) -> str:
    """A recorded `argus probe --json` line with a few values anywhere in it replaced."""
    d = json.loads(RECORDED)
    for _ in range(draw(st.integers(1, 4))):
        parent, key = None, None
        cur: Any = d
        while isinstance(cur, dict) and cur and (key is None or draw(st.booleans())):
            parent, key = cur, draw(st.sampled_from(sorted(cur)))
            cur = cur[key]
        if parent is not None:
            parent[key] = draw(json_like)
    return json.dumps(d)


lines = st.one_of(
    mutated_summary(),
    json_like.map(json.dumps),
    st.text(max_size=200),
    st.integers(1, 20_000).map(lambda n: "[" * n),  # deep nesting: json's RecursionError
    st.just('{"step": 1e999}'),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(line=lines)
def test_any_line_is_a_summary_or_bad_data_in_every_jsonl_reader(line: str, tmp_path_factory: Any) -> None:
    try:
        list(load_jsonl(io.StringIO(line + "\n")))
    except BadData as e:
        assert len(e.message) <= 300
    f: Path = tmp_path_factory.mktemp("jsonl") / "steps.jsonl"
    f.write_text(line + "\n")
    try:
        list(JsonlSource(f))
    except BadData as e:
        assert len(e.message) <= 300


def test_a_line_of_a_json_array_is_named_in_one_line() -> None:
    with pytest.raises(BadData) as e:
        list(load_jsonl(io.StringIO("[1, 2]\n"), "steps.jsonl"))
    assert (
        e.value.message
        == "steps.jsonl:1: not an `argus probe --json` summary (TypeError: a JSON list, not an object)"
    )


@pytest.mark.redis
def test_entries_claiming_another_job_are_rejected_and_counted(redis_client: Any) -> None:
    """An agent misconfigured (or forged) to write job B's summaries into job A's stream must not
    make A's aggregator judge B's ranks as A's."""
    redis_client.delete(k_steps("job-a"), k_hb("job-a"))
    mine, theirs = steps(n_ranks=2, n_steps=2, job="job-a"), steps(n_ranks=2, n_steps=1, job="someone-else")
    for rs in mine + theirs:
        redis_client.xadd(k_steps("job-a"), {b"d": wire.encode_step(rs)})
    for job in ("job-a", "someone-else"):
        hb = Heartbeat(job, "host:1", "host", time.time_ns(), ranks={0: 1})
        redis_client.xadd(k_hb("job-a"), {b"d": wire.encode_heartbeat(hb)})
    stats = reader.ReaderStats()
    got = [m for _, m in reader.iter_steps(redis_client, "job-a", stats)]
    assert {(m.job, m.rank, m.step) for m in got} == {(rs.job, rs.rank, rs.step) for rs in mine}
    assert stats.rejected == {"other-job": len(theirs)}
    hbs = reader.heartbeats(redis_client, "job-a", stats=stats)
    assert [hb.job for _, hb in hbs] == ["job-a"], stats.rejected
    assert stats.rejected["heartbeat:other-job"] == 1
    assert any("other-job 2" in line for line in reader.notices(stats, "job-a"))
