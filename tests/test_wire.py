"""argus.wire: round trips within the documented quantisation, the size budget, and a strict decoder
that turns every hostile or broken entry into a counted WireError (never another exception)."""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import zlib
from pathlib import Path
from typing import Any, Dict, List, Set

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from argus import wire
from argus.replay import Straggler, load_jsonl, synthetic_steps
from argus.schema import OPS, CommStep, GpuArrival, Heartbeat, InFlight, P2POp, RankStep, from_probe
from tests.wirecheck import assert_equivalent

DATA = Path(__file__).parent / "data"
BUDGET = 2700  # bytes per rank per step
T0 = 1_796_000_000 * 10**9  # a realtime ns in range


def probe_steps(name: str) -> List[RankStep]:
    with open(DATA / name) as f:
        return list(load_jsonl(f, name))


def names_of(steps: List[RankStep]) -> Dict[int, str]:
    out: Dict[int, str] = {}
    for rs in steps:
        out.update(wire.step_names(rs))
    return out


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["probe-default-dp4.jsonl", "probe-heavy-tpdp4.jsonl"])
def test_recorded_probe_steps_round_trip_within_budget(fixture: str) -> None:
    steps = probe_steps(fixture)
    names = names_of(steps)
    for rs in steps:
        data = wire.encode_step(rs)
        assert len(data) <= BUDGET, (rs.rank, rs.step, len(data))
        assert_equivalent(wire.decode_step(data, names), rs)


def test_heavy_step_is_well_under_budget_and_much_smaller_than_json() -> None:
    lines = (DATA / "probe-heavy-tpdp4.jsonl").read_text().splitlines()
    steps = probe_steps("probe-heavy-tpdp4.jsonl")
    assert all(sum(len(c) for c in rs.comms.values()) >= 200 and rs.launches >= 2000 for rs in steps)
    sizes = [len(wire.encode_step(rs)) for rs in steps]
    assert max(sizes) < 0.6 * BUDGET
    assert statistics.median(sizes) * 10 < statistics.median(len(x) for x in lines)


def test_synthetic_steps_round_trip_and_model_a_straggler() -> None:
    steps = list(synthetic_steps("job:a", 16, 4, straggler=Straggler(5, 1.5, 2), seed=3))
    assert len(steps) == 64
    names = names_of(steps)
    for rs in steps:
        assert_equivalent(wire.decode_step(wire.encode_step(rs), names), rs)
        assert len(wire.encode_step(rs)) <= BUDGET
    by = {(rs.rank, rs.step): rs for rs in steps}

    def lateness(rank: int, step: int) -> float:
        c = next(iter(by[(rank, step)].comms.values()))
        return statistics.median(a - by[(rank, step)].start_ns for a in c.arrive_ns)

    others = [lateness(r, 3) for r in range(16) if r != 5]
    assert lateness(5, 3) > 1.2 * max(others)  # late at every all-reduce once the fault is on
    assert lateness(5, 1) < 1.05 * max(lateness(r, 1) for r in range(16) if r != 5)
    assert len({by[(r, 3)].duration_ns for r in range(16)}) == 1  # everyone waits for it


def test_quantisation_bounds_are_what_the_docs_say() -> None:
    assert wire.HOST_REL_ERROR == pytest.approx(0.0219, abs=1e-4)
    for ns in (0, 1, 2, 3, 999, 1_500, 123_456, 10**9, 10**13, 2**62):
        got = wire.host_unq(wire.host_q(ns))
        assert abs(got - max(ns, 1)) <= wire.HOST_REL_ERROR * max(ns, 1) + 1


def test_colliding_kernel_names_are_sent_inline() -> None:
    a, b = "k97872", "k15860000"  # found by brute force: CRC-32 collisions exist among real names too
    assert zlib.crc32(a.encode()) == zlib.crc32(b.encode())
    rs = RankStep("j", 0, "h", 1, 1, T0, 10, kernels={a: 3, b: 4, "gemm": 5})
    names = wire.step_names(rs)
    assert set(names.values()) == {a, "gemm"}
    back = wire.decode_step(wire.encode_step(rs), names)
    assert back.kernels == {a: 3, b: 4, "gemm": 5}
    back = wire.decode_step(wire.encode_step(rs, inline={"gemm"}), {})
    assert back.kernels["gemm"] == 5


def test_unknown_kernel_ids_are_reported_missing() -> None:
    rs = RankStep("j", 0, "h", 1, 1, T0, 10, kernels={"gemm": 5})
    missing: set = set()
    back = wire.decode_step(wire.encode_step(rs), {}, missing)
    assert missing == {wire.name_id("gemm")} and back.kernels == {f"#{wire.name_id('gemm'):08x}": 5}


def test_heartbeat_round_trip() -> None:
    hb = Heartbeat(
        "job:1",
        "host-a:77",
        "host-a",
        T0,
        ranks={0: 100, 1: 101},
        inflight=[
            InFlight(1, 101, "ncclAllReduce", T0 - 5 * 10**9, "00000000deadbeef", 42),
            InFlight(0, 100, "cuStreamSynchronize", T0 - 10**9),
        ],
        last_seq={0: {"00000000deadbeef": 41}, 1: {"00000000deadbeef": 42}},
        last_step={0: 3},
        drops={"ringbuf": 2},
        health={"published": 10, "cpu_ms": 5},
        where={
            0: "blocked in cuStreamSynchronize (libcuda.so.1) from step (train.py:9)",
            1: "in f (t.py:3), futex",
        },
        attach_blocked=[0],
        inflight_comm={1: [8, 3]},
    )
    assert wire.decode_heartbeat(wire.encode_heartbeat(hb)) == hb
    with pytest.raises(wire.WireError) as e:
        wire.decode_step(wire.encode_heartbeat(hb))
    assert e.value.reason == "kind"
    with pytest.raises(wire.WireError):
        wire.decode_heartbeat(wire.encode_step(RankStep("j", 0, "h", 1, 1, T0, 10)))


def test_a_newer_writers_extra_keys_are_skipped_and_named() -> None:
    """Agents are upgraded before readers: a field a newer agent adds must not make an older
    aggregator reject every summary (a field it must not skip bumps the schema version)."""
    base = wire.decode_step(valid_entry(), {})
    d = msgpack.unpackb(valid_entry(), strict_map_key=False)
    d["zz"] = {"any": [1, 2]}
    d["c"][0]["q9"] = 1
    ignored: Set[str] = set()
    assert wire.decode_step(msgpack.packb(d), {}, None, ignored) == base
    assert ignored == {"step:zz", "comm:q9"}
    hb = Heartbeat("j", "a", "h", T0, ranks={0: 5})
    h = msgpack.unpackb(wire.encode_heartbeat(hb), strict_map_key=False)
    h["new"] = 3
    ignored = set()
    assert wire.decode_heartbeat(msgpack.packb(h), ignored) == hb and ignored == {"heartbeat:new"}
    assert wire.decode_step(valid_entry(), {}, None, ignored) == base  # nothing new: nothing added
    assert ignored == {"heartbeat:new"}


def test_an_older_agents_retired_keys_are_dropped_quietly() -> None:
    """`hc` (host-time KDE clusters) and `la` (launch-call clusters) were shipped and never read;
    an agent from before their removal still sends them: accepted, dropped, not called new."""
    base = wire.decode_step(valid_entry(), {})
    d = msgpack.unpackb(valid_entry(), strict_map_key=False)
    d["la"] = [3, 1000, 20]
    d["c"][0]["hc"] = {0: [5, 1200, 30]}
    ignored: Set[str] = set()
    assert wire.decode_step(msgpack.packb(d), {}, None, ignored) == base
    assert ignored == set()
    assert "la" not in msgpack.unpackb(wire.encode_step(base), strict_map_key=False)


def test_every_schema_field_is_on_the_wire() -> None:
    """A field added to RankStep, CommStep or Heartbeat must be added to argus/wire.py (and
    docs/schema.md) too: otherwise readers silently get its default."""
    assert {f.name for f in dataclasses.fields(RankStep)} == set(wire.STEP_FIELDS)
    assert {f.name for f in dataclasses.fields(CommStep)} == set(wire.COMM_FIELDS)
    assert {f.name for f in dataclasses.fields(Heartbeat)} == set(wire.HEARTBEAT_FIELDS)


# ---- property: any valid RankStep round-trips ------------------------------------------------------

small = st.integers(0, 10**6)
i64 = st.integers(-(2**62), 2**62)
text = st.text(max_size=20)


@st.composite
def comm_steps(draw: Any, t0: int) -> CommStep:
    n = draw(st.integers(0, 40))
    seqs = sorted(draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)))
    ops = draw(st.lists(st.sampled_from([*OPS[:5], "AllToAll"]), min_size=n, max_size=n))
    p2p = [
        P2POp(draw(st.sampled_from(["Send", "Recv"])), draw(st.integers(-1, 64)), draw(small),
              t0 + draw(st.integers(-(10**9), 10**13)), draw(st.integers(0, 10**12)))
        for _ in range(draw(st.integers(0, 4)))
    ]  # fmt: skip
    return CommStep(
        f"{draw(st.integers(0, 2**64 - 1)):016x}",
        draw(st.integers(-1, 4096)),
        draw(st.integers(-1, 4096)),
        draw(st.sampled_from(wire.IDENTITIES)),
        seqs=seqs,
        ops=ops,
        nbytes=draw(st.lists(st.sampled_from([0, 4, 2**20, 2**40]), min_size=n, max_size=n)),
        arrive_ns=[t0 + x for x in draw(st.lists(st.integers(-(10**9), 10**13), min_size=n, max_size=n))],
        host_ns=draw(st.lists(st.integers(0, 10**13), min_size=n, max_size=n)),
        p2p=p2p,
    )


@st.composite
def rank_steps(draw: Any) -> RankStep:
    t0 = draw(st.integers(wire.REALTIME[0], wire.REALTIME[0] + 10**17))
    comms = {c.comm: c for c in draw(st.lists(comm_steps(t0), max_size=3))}
    return RankStep(
        job=draw(text),
        rank=draw(st.integers(-1, 100_000)),
        host=draw(text),
        pid=draw(st.integers(0, 2**22)),
        step=draw(st.none() | st.integers(0, 2**53)),
        start_ns=t0,
        duration_ns=draw(st.integers(0, 10**13)),
        local_rank=draw(st.integers(-1, 7)),
        world_size=draw(st.integers(-1, 100_000)),
        step_source=draw(st.sampled_from(["nccl-seq", "ordinal", "tail"])),
        clock_offset_ns=draw(i64),
        clock_uncertainty_ns=draw(st.integers(0, 10**10)),
        sync_count=draw(small),
        sync_wait_ns=draw(st.integers(0, 10**12)),
        phases=draw(st.dictionaries(text, i64, max_size=6)),
        phase_stream=draw(st.dictionaries(text, st.integers(0, 5), max_size=4)),
        py_phases=draw(st.dictionaries(text, st.integers(0, 10**12), max_size=4)),
        launches=draw(small),
        launches_sampled=draw(st.booleans()),
        kernels=draw(st.dictionaries(st.text(min_size=1, max_size=60), small, max_size=10)),
        memcpy=draw(st.dictionaries(st.sampled_from(["HtoD", "DtoH", "DtoD"]), st.tuples(small, small))),
        errors=draw(st.dictionaries(text, st.dictionaries(st.integers(-(2**31), 2**31), small, max_size=3))),
        comms=comms,
        drops=draw(st.dictionaries(text, small, max_size=3)),
        gpu=draw(
            st.dictionaries(
                st.text(min_size=1, max_size=32),
                st.floats(-1e12, 1e12, allow_nan=False) | st.integers(0, 10**6).map(float),
                max_size=12,
            )
        ),
        gpu_arrival=draw(st.none() | gpu_arrivals(t0)),
    )


@st.composite
def gpu_arrivals(draw: Any, t0: int) -> GpuArrival:
    t = st.integers(-(10**12), 10**13).map(lambda x: t0 + x)
    row = st.tuples(st.integers(0, 4000), t, st.just(0) | t, st.sampled_from(["hq", "qe", "h-", "ss"]))
    return GpuArrival(
        step=draw(st.none() | st.integers(0, 2**53)),
        bounds=draw(
            st.dictionaries(st.sampled_from(["00ab", "c0ffee"]), st.lists(row, max_size=5), max_size=2)
        ),
        net_first_ns=draw(st.just(0) | t),
        coll_gpu_ns=draw(
            st.dictionaries(st.sampled_from(["00ab"]), st.lists(st.integers(0, 10**12), max_size=4))
        ),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rank_steps())
def test_any_rank_step_round_trips(rs: RankStep) -> None:
    names = wire.step_names(rs)
    assert_equivalent(wire.decode_step(wire.encode_step(rs), names), rs)


# ---- hostile input: only WireError, always with a reason -------------------------------------------


@functools.cache
def valid_entry() -> bytes:
    return wire.encode_step(next(iter(synthetic_steps("j", 2, 1, seed=1))))


def rejects(data: Any, reason: str = "") -> str:
    with pytest.raises(wire.WireError) as e:
        wire.decode_step(data, {})
    assert e.value.reason and (not reason or e.value.reason == reason), e.value
    assert e.value.exit_code == 9 and e.value.hint  # a BadData
    return e.value.reason


def patched(**changes: Any) -> bytes:
    d = msgpack.unpackb(valid_entry(), strict_map_key=False)
    d.update(changes)
    return msgpack.packb(d, use_bin_type=True)


def patched_comm(**changes: Any) -> bytes:
    d = msgpack.unpackb(valid_entry(), strict_map_key=False)
    d["c"][0].update(changes)
    return msgpack.packb(d, use_bin_type=True)


def test_hostile_examples_are_rejected_with_reasons() -> None:
    rejects("not bytes", "type")
    rejects(b"\xc1", "msgpack")  # never-used msgpack byte
    rejects(valid_entry()[:-3], "msgpack")  # truncated
    rejects(valid_entry() + b"\x00", "msgpack")  # trailing bytes
    rejects(b"\x00" * (wire.MAX_ENTRY_BYTES + 1), "size")
    rejects(msgpack.packb([1, 2, 3]), "type")
    rejects(patched(v=2), "version")
    rejects(patched(v="1"), "version")
    rejects(patched(r="3"), "type")
    rejects(patched(r=True), "type")  # bools are not ints here
    rejects(patched(r=2**40), "range")
    rejects(patched(t0=5), "range")  # 1970: not a realtime ns
    rejects(patched(dt=-1), "range")
    rejects(patched(j="x" * 10_000), "size")
    rejects(patched(k=list(range(3))), "type")  # odd (id, count) array
    rejects(patched(k=[1.5, 2]), "type")
    rejects(msgpack.packb({**msgpack.unpackb(valid_entry(), strict_map_key=False), 7: 1}), "type")  # int key
    rejects(patched(toolongkey=1), "type")
    rejects(patched(ph={"a": float("nan")}), "type")
    rejects(patched(l=-1), "range")
    rejects(patched(c=[{"id": 1}] * 600), "size")
    rejects(patched_comm(a=list(range(70_000))), "size")  # huge array
    rejects(patched_comm(hq=[1]), "range")  # fewer host times than arrivals
    rejects(patched_comm(op=[0, 999]), "range")  # runs do not cover the instances
    rejects(patched_comm(op=[99, 24]), "range")  # op code out of range
    rejects(patched_comm(i="bogus"), "range")
    rejects(patched_comm(id=-5), "range")
    rejects(msgpack.packb({"v": 1, "j": msgpack.ExtType(5, b"x")}), "msgpack")
    rejects(b"\x82\xa1v\x01\xa2ph" + b"\x91" * 5000 + b"\x01", "msgpack")  # nested 5,000 deep


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_never_raise_anything_but_wire_error(data: bytes) -> None:
    try:
        wire.decode_step(data, {})
    except wire.WireError as e:
        assert e.reason


msgpack_int = st.integers(-(2**63), 2**64 - 1)
json_like = st.recursive(
    st.none() | st.booleans() | msgpack_int | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=3) | msgpack_int, inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_entries_never_raise_anything_but_wire_error(data: st.DataObject) -> None:
    d = msgpack.unpackb(valid_entry(), strict_map_key=False)
    target = d if data.draw(st.booleans()) else d["c"][0]
    key = data.draw(st.sampled_from([*sorted(target, key=str), "new"]))
    target[key] = data.draw(json_like)
    raw = msgpack.packb(d, use_bin_type=True)
    cut = data.draw(st.integers(0, len(raw)))
    for blob in (raw, raw[:cut]):
        try:
            rs = wire.decode_step(blob, {})
        except wire.WireError as e:
            assert e.reason
        else:
            assert isinstance(rs, RankStep)
            wire.decode_step(wire.encode_step(rs), wire.step_names(rs))  # what passed is re-encodable


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=500) | json_like.map(lambda x: msgpack.packb(x, use_bin_type=True)))
def test_hostile_heartbeats_raise_only_wire_error(data: bytes) -> None:
    try:
        wire.decode_heartbeat(data)
    except wire.WireError as e:
        assert e.reason


def test_from_probe_of_recorded_lines_keeps_the_clock_uncertainty() -> None:
    d = json.loads((DATA / "probe-default-dp4.jsonl").read_text().splitlines()[0])
    d["wall_offset_err_ns"] = 1234
    assert from_probe(d).clock_uncertainty_ns == 1234


def test_new_identities_keep_older_readers_working() -> None:
    """`table`/`accessors`/`inferred` are new: `i` carries the value a reader from before them
    accepts (`attach`/`handle`), `ix` the identity itself (such a reader skips that key)."""
    rs = wire.decode_step(valid_entry(), {})
    cid = next(iter(rs.comms))
    rs.comms[cid].identity = "accessors"
    raw = msgpack.unpackb(wire.encode_step(rs), strict_map_key=False)
    assert (raw["c"][0]["i"], raw["c"][0]["ix"]) == ("handle", "accessors")
    assert wire.decode_step(wire.encode_step(rs), {}).comms[cid].identity == "accessors"
    rs.comms[cid].identity = "init"
    assert "ix" not in msgpack.unpackb(wire.encode_step(rs), strict_map_key=False)["c"][0]


def test_gpu_arrival_nonsense_is_refused() -> None:
    ga = GpuArrival(4, {"00ab": [(0, T0 - 5000, T0 + 9000, "qq")]}, T0 + 7000, {"00ab": [40_000]})
    rs = RankStep("j", 3, "h", 1, 5, T0, 10, gpu_arrival=ga)
    assert wire.decode_step(wire.encode_step(rs)).gpu_arrival == ga
    for bad in (
        {"b": {"00ab": [[0, 1, 2]]}},
        {"b": {"00ab": [[0, "x", 2, "qq"]]}},
        {"t": {"00ab": [-1]}},
        {"b": {"00ab": [[0, 1, 2, "too long"]]}},
    ):
        raw = msgpack.unpackb(wire.encode_step(rs), raw=False)
        raw["ga"] = bad
        with pytest.raises(wire.WireError):
            wire.decode_step(msgpack.packb(raw))


def test_gpu_metrics_travel_and_nonsense_is_refused() -> None:
    g = {"device": 3.0, "sm_mhz": 1095.0, "sm_max_mhz": 1980.0, "throttle": 8.0, "power_w": 512.4}
    rs = RankStep("j", 3, "h", 1, 1, T0, 10, gpu=g)
    assert wire.decode_step(wire.encode_step(rs)).gpu == g
    for bad in ({"sm_mhz": "fast"}, {"x" * 33: 1}, {"power_w": float("nan")}, {"t": 1e16}):
        raw = msgpack.unpackb(wire.encode_step(rs), raw=False)
        raw["g"] = bad
        with pytest.raises(wire.WireError):
            wire.decode_step(msgpack.packb(raw))
