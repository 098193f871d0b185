"""`argus probe --json` and RankStep are one summary in two forms (argus.schema): the tracker builds
the RankStep with its probe detail, `to_probe_json` is what `--json` prints, `from_probe` reads it
back exactly; the wire carries the summary without the detail.

Golden input: tests/data/probe-json-golden.jsonl, lines `argus probe --json` printed on the
simulated job before the tracker built RankSteps (DP with the host channel and NVML's stand-in,
pipeline send/recv in groups, a heavy TP job losing records, --launch-steps windows and `all`, an
attach in the middle of a run, the tails); tests/data/probe-json-tracker-edge.jsonl, what that
tracker printed for tests/probe_edge.py's feed (the cases the simulated job rarely prints).
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any, List

import pytest
from rich.console import Console

from argus import wire
from argus.agent.launchwin import LaunchWindows
from argus.agent.render import RankView, fmt_bytes, render
from argus.probes import base, libcuda, libcudart, libnccl
from argus.schema import RankStep, error_channel, from_probe, read_jsonl, to_probe_json
from argus.sim.launcher import SimConfig
from tests import probe_edge
from tests.probing import probed_run
from tests.wirecheck import assert_equivalent

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "probe-json-golden.jsonl"
EDGE = DATA / "probe-json-tracker-edge.jsonl"


def lines(path: Path) -> List[str]:
    return path.read_text().splitlines()


def printed(rs: RankStep) -> str:
    """The line `argus probe --json` prints for `rs`."""
    return json.dumps(to_probe_json(rs), separators=(",", ":"))


def assert_round_trips(line: str) -> RankStep:
    rs = from_probe(json.loads(line))
    assert printed(rs) == line
    assert from_probe(json.loads(printed(rs))) == rs
    return rs


def test_recorded_lines_print_again_byte_for_byte() -> None:
    got = [assert_round_trips(line) for line in lines(GOLDEN)]
    # what the fixture covers, so that a shrunken one fails here rather than proving less
    dets = [rs.detail for rs in got if rs.detail is not None]
    assert len(dets) == len(got) == 11
    assert any(rs.step is None for rs in got) and any(rs.step_source == "ordinal" for rs in got)
    assert any(c.p2p for rs in got for c in rs.comms.values())
    assert any(any(cd.p2p_grouped) for d in dets for cd in d.nccl.comms.values())
    assert any(rs.drops for rs in got) and any(not rs.launches_sampled for rs in got)
    assert any(not d.cuda.sampled_said for d in dets) and any(
        d.period and d.period.source is None for d in dets
    )
    assert any(rs.gpu_arrival and rs.gpu_arrival.coll_gpu_ns for rs in got)
    assert any({"python", "host_cpu"} <= set(d.sections) for d in dets) and any(d.gpu for d in dets)
    assert any(rs.py_phases and rs.gpu for rs in got)


def _label(steps: List[Any]) -> None:
    """Launch windows as the session labels steps: one in three outside a window, one inside."""
    inside, outside = LaunchWindows(3, 30, windows=[(0, 1 << 62)]), LaunchWindows(3, 30)
    for i, rs in enumerate(steps):
        if i % 3:
            (outside if i % 3 == 1 else inside).label([rs])


def test_the_tracker_prints_what_it_printed_before_and_reads_it_back() -> None:
    """The tracker's RankSteps give, through to_probe_json, exactly the objects the tracker built
    before (recorded from the same feed), and from_probe rebuilds each RankStep, detail included."""
    got = probe_edge.run(
        lambda t, fb: t.finalize_steps(fb, probe_edge.WALL, probe_edge.ERR),
        lambda t: t.flush_tail_step(probe_edge.WALL, probe_edge.ERR),
    )
    steps = [rs for rs in got if rs is not None]
    _label(steps)
    assert [printed(rs) for rs in steps] == lines(EDGE)
    for rs in steps:
        assert from_probe(json.loads(printed(rs))) == rs
    det = [rs.detail for rs in steps if rs.detail is not None]
    assert any(d.nccl.inits for d in det) and any(d.end_ns == 0 for d in det)
    assert any(r is not None for d in det for cd in d.nccl.comms.values() for r in cd.roots)
    # collectives whose records came out of sequence order: sorted in the CommStep, printed as seen
    printed_order = [[i for k, i in d.nccl.order if k == key and i >= 0] for d in det for key in d.nccl.comms]
    assert any(idx != sorted(idx) for idx in printed_order)
    assert all(c.seqs == sorted(c.seqs) for rs in steps for c in rs.comms.values())
    # the typed fields the aggregator reads agree with the detail they came with
    rs = steps[5]
    assert rs.errors == {"cuEventQuery": {600: 2}, "cudaMalloc": {2: 1}, "ncclAllReduce": {3: 1}}
    assert rs.detail is not None and rs.detail.sections["python"]["phases"]["compile"] == 0
    assert rs.py_phases == {"forward": 1006, "backward": 2012}  # phases that took no time left out
    assert rs.phase_stream == {"timer0": 0, "timer1": 1}
    assert rs.gpu_arrival is not None and rs.gpu_arrival.net_first_ns > probe_edge.WALL


def test_the_legacy_dict_forms_are_the_typed_ones_printed() -> None:
    """RankTracker.finalize/flush_tail and Session.steps (tests and tools that read dicts) are
    to_probe_json of the typed steps, so they cannot drift from what --json prints."""
    a = probe_edge.run(lambda t, fb: t.finalize(fb, probe_edge.WALL), lambda t: t.flush_tail(probe_edge.WALL))
    b = probe_edge.run(
        lambda t, fb: t.finalize_steps(fb, probe_edge.WALL), lambda t: t.flush_tail_step(probe_edge.WALL)
    )
    assert a == [None if rs is None else to_probe_json(rs) for rs in b]


def test_lines_of_older_agents_read_with_defaults_and_print_in_todays_form() -> None:
    for name in ("probe-default-dp4.jsonl", "probe-heavy-tpdp4.jsonl"):
        for line in lines(DATA / name):
            d = json.loads(line)
            rs = from_probe(d)
            assert to_probe_json(rs) == {**d, "wall_offset_err_ns": 0}  # the one key they lacked
            assert from_probe(to_probe_json(rs)) == rs


def test_one_reader_for_files_and_the_wire_leaves_the_detail_out() -> None:
    with GOLDEN.open() as f:
        steps = [x for x in read_jsonl(f, "golden") if isinstance(x, RankStep)]
    assert [printed(rs) for rs in steps] == lines(GOLDEN)
    names = {k: v for rs in steps for k, v in wire.step_names(rs).items()}
    for rs in steps:
        bare = dataclasses.replace(rs, detail=None)
        assert wire.encode_step(rs) == wire.encode_step(bare)  # not one byte of it on the wire
        back = wire.decode_step(wire.encode_step(rs), names)
        assert back.detail is None
        assert_equivalent(back, rs)
        with pytest.raises(ValueError, match="no probe detail"):
            to_probe_json(back)


def test_errors_are_printed_in_their_channels_section() -> None:
    """RankStep.errors holds every channel's; --json prints each in its channel's section, told by
    the call's name: true of every call a channel probes."""
    for mod in (libcuda, libcudart, libnccl):
        base.register_channel(mod.CHANNEL)
    checked = 0
    for name, channel in zip(base.ALL_CALLS, base.CALL_CHANNELS):
        if channel in ("cuda", "cudart", "nccl"):
            assert error_channel(name) == channel, name
            checked += 1
    assert checked >= 60


def test_the_live_table_reads_ranksteps() -> None:
    line = lines(GOLDEN)[0]
    d, rs = json.loads(line), from_probe(json.loads(line))
    view = RankView(rs.pid, rs.rank, rs.host)
    view.update(rs)
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(render([view], {}, "argus probe"))
    out = console.export_text()
    op, o = max(d["nccl"]["ops"].items(), key=lambda kv: kv[1]["bytes"])
    kernels = ", ".join(f"{k} ×{v}" for k, v in list(d["cuda"]["launches"]["by_kernel"].items())[:2])
    call, codes = next(iter(d["cuda"]["errors"].items()))
    code, n = next(iter(codes.items()))
    for want in (f"{op} ×{o['count']} {fmt_bytes(o['bytes'])}", kernels, f"{call}={code}×{n}"):
        assert want in out, (want, out)
    assert f" {d['cuda']['launches']['total']} │" in out, out


@pytest.mark.bpf
def test_every_line_a_live_probe_prints_reads_back_exactly(tmp_path: Path) -> None:
    _job, probe = probed_run(
        SimConfig(timers=True, ranks=4, steps=5, layout="pp-dp", preset="small", run_dir=str(tmp_path))
    )
    out = [line.rstrip("\n") for line in probe.out if line.strip()]
    assert len(out) >= 4 * 4, probe.stderr[-2000:]
    for line in out:
        assert_round_trips(line)
