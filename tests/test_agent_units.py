"""Pure parts of the agent, without root: step detection, record bookkeeping, identity, prologues, ELF."""

from __future__ import annotations

import struct
from typing import List, Optional

import click
import pytest

from argus.agent.commands import parse_duration
from argus.agent.identity import from_environ
from argus.agent.steps import EpochSig, StepDetector, find_period
from argus.agent.tracker import RankTracker, fnv1a64
from argus.probes import libnccl
from argus.probes.base import call_id
from argus.probes.elf import Elf
from argus.probes.prologue import plan_entry, skippable
from argus.probes.records import (
    CollKey,
    CollVal,
    RecCommInit,
    RecElapsed,
    RecFuncName,
    RecNccl,
    RecSync,
)
from argus.sim.build import build

SYNC_END = ("cuStreamSynchronize", 0xA, 1)
SYNC_CLIP = ("cuStreamSynchronize", 0xB, 1)


def sig(
    e: int, sync: object, colls: int, t: int, first: Optional[int] = None, last: Optional[int] = None
) -> EpochSig:
    c = ((("dp", "AllReduce"), colls),) if colls else ()
    return EpochSig(e, sync, c, t, first, last)


def test_period_one_sync_per_step() -> None:
    sigs = [sig(e, SYNC_END, 24, e * 100, e * 100 + 40, e * 100 + 90) for e in range(12)]
    assert find_period(sigs) == (1, 1.0)


def test_period_two_syncs_cuts_at_the_end_of_step_sync() -> None:
    """Step: backward all-reduces, clip-grad sync, optimizer, end-of-step sync, next step's data+forward."""
    sigs = []
    for step in range(10):
        t = step * 1000
        # epoch closed by the clip sync: contains the all-reduces (t+300..t+700)
        sigs.append(sig(2 * step, SYNC_CLIP, 24, t + 750, t + 300, t + 700))
        # epoch closed by the end-of-step sync: optimizer only
        sigs.append(sig(2 * step + 1, SYNC_END, 0, t + 900))
    d = StepDetector()
    for s in sigs:
        d.add(s)
    assert d.period is not None and d.period.length == 2
    assert d.period.sync == SYNC_END
    assert [s.epoch for s in sigs if d.is_boundary(s)] == [2 * k + 1 for k in range(10)]


def test_no_period_for_noise_and_other_syncs_never_cut() -> None:
    import random

    rnd = random.Random(1)
    noisy = [sig(e, ("cuStreamSynchronize", rnd.randrange(9), 1), rnd.randrange(5), e) for e in range(40)]
    assert find_period(noisy) is None
    d = StepDetector()
    for e in range(12):
        d.add(sig(e, SYNC_END, 8, e * 10))
    odd = sig(12, ("cuCtxSynchronize", 0, 1), 0, 125)  # e.g. a checkpoint's sync
    d.add(odd)
    assert not d.is_boundary(odd)


def hdr(kind: int, call: str, epoch: int, ts: int, tgid: int = 7) -> dict:
    return {"kind": kind, "tgid": tgid, "tid": tgid, "call": call_id(call), "ts": ts, "epoch": epoch}


def set_hdr(rec: object, **h: int) -> None:
    for k, v in h.items():
        setattr(rec.h, k, v)  # type: ignore[attr-defined]


def sync_rec(epoch: int, enter: int, exit_: int) -> RecSync:
    r = RecSync(enter_ns=enter, handle=0xA, result=0, bytes_kind=0xFFFFFFFF)
    set_hdr(r, **hdr(1, "cuStreamSynchronize", epoch, exit_))
    return r


def nccl_rec(epoch: int, comm: int, seq: int, enter: int, count: int = 1024) -> RecNccl:
    r = RecNccl(comm=comm, seq=seq, count=count, dtype=9, peer=-1, flags=2, enter_ns=enter)
    set_hdr(r, **hdr(5, "ncclAllReduce", epoch, enter + 5000))
    return r


def make_tracker() -> RankTracker:
    ident = from_environ(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "j1"}, 7, "h"
    )
    return RankTracker(ident, libnccl.CommLayout("table", 8, 16, 20))


def feed_steps(t: RankTracker, steps: int, per_step: int = 4) -> None:
    uid = bytes(range(128))
    init = RecCommInit(comm=0xC0, nranks=8, rank=3, result=0, comm_rank=-1, comm_nranks=-1, has_uid=1)
    init.uid[:] = list(uid)
    set_hdr(init, **hdr(6, "ncclCommInitRank", 0, 10))
    t.on_record(init)
    fn = RecFuncName(func=0xF1, result=0, name=b"gemm")
    set_hdr(fn, **hdr(2, "cuModuleGetFunction", 0, 11))
    t.on_record(fn)
    for e in range(steps):
        base = 1_000_000 * (e + 1)
        for i in range(per_step):
            t.on_record(nccl_rec(e, 0xC0, 1 + e * per_step + i, base + 1000 * i))
        t.add_launches(e, 0xF1, 50)
        t.add_launches(e, 0xF2, 3)
        t.add_call(e, call_id("cuEventRecord"), 1)  # 0xE1, recorded at base + 10 (BPF keeps it)
        t.on_record(sync_rec(e, base + 500_000, base + 900_000))
        el = RecElapsed(start_ev=0xE0, end_ev=0xE1, ms_bits=struct.unpack("<I", struct.pack("<f", 1.5))[0])
        el.end_stream, el.end_pos, el.end_ns, el.end_epoch = 0x55, 1 + e, base + 10, e
        set_hdr(el, **hdr(4, "cuEventElapsedTime", e + 1, base + 950_000))  # read after the step's sync
        t.on_record(el)
        t.add_error(e, call_id("cuEventQuery"), 600, 1)


def test_a_cut_interrupted_midway_never_cuts_an_epoch_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception (a Ctrl-C, once) while steps are being cut loses at most the steps of that call;
    it must not leave their epochs queued, to be cut again as steps with no data (end 0, no sync),
    as `argus probe` printed in 4 of 45 recorded runs stopped by SIGINT."""
    t = make_tracker()
    feed_steps(t, 10)
    real = RankTracker.summarize
    calls = {"n": 0}

    def flaky(self: RankTracker, *a: object, **k: object) -> object:
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(RankTracker, "summarize", flaky)
    with pytest.raises(KeyboardInterrupt):
        t.finalize(10)
    monkeypatch.setattr(RankTracker, "summarize", real)
    out = t.finalize(10)
    assert out and all(s["end_ns"] > 0 and s["cuda"]["sync"]["count"] == 1 for s in out), out
    # the interrupted step is cut again, whole; the three before it are not
    assert [s["step"] for s in out] == list(range(4, 10)), [s["step"] for s in out]


def test_tracker_cuts_steps_and_summarises() -> None:
    t = make_tracker()
    feed_steps(t, 10)
    out: List[dict] = t.finalize(10)
    assert [s["step"] for s in out] == list(range(1, 10))  # the first boundary only starts tracking
    s = out[0]
    assert (s["rank"], s["world_size"], s["job"], s["host"], s["pid"]) == (3, 8, "j1", "h", 7)
    assert s["cuda"]["launches"]["by_kernel"] == {"gemm": 50, "fn@0xf2": 3}
    assert s["cuda"]["timers"] == [{"ms": 1.5, "start_event": "0xe0", "end_event": "0xe1", "stream": "0x55"}]
    assert s["cuda"]["errors"] == {"cuEventQuery": {"600": 1}}
    assert s["cuda"]["sync"]["wait_ns"] == 400_000
    key = f"{fnv1a64(bytes(range(128))):016x}"
    assert s["nccl"]["comms"][key]["identity"] == "init" and s["nccl"]["comms"][key]["nranks"] == 8
    assert s["nccl"]["ops"]["AllReduce"] == {"count": 4, "bytes": 4 * 1024 * 2, "host_ns": 4 * 5000}
    assert s["duration_ns"] == 1_000_000 and s["step_source"] == "nccl-seq"
    tail = t.flush_tail()
    assert tail is None or tail["step"] is None


def _tracker_over(mem: bytearray, layout: libnccl.CommLayout, base: int = 0x99) -> RankTracker:
    def read(addr: int, n: int) -> bytes:
        return bytes(mem[addr - base : addr - base + n])

    return RankTracker(from_environ({}, 1, "h"), layout, read_mem=read)


def test_past_its_records_per_step_a_communicator_is_sampled_and_counted_exactly() -> None:
    """200 all-reduces a step, at most 64 records: after two equal steps the tracker asks BPF for
    every 4th (200 / 4 = 50, a stride dividing the step so each step's first is among them), the
    phase putting the step's first collective among them. Its summaries then carry 50 instances at
    positions 0, 4, 8, ... with the exact count, bytes and host time from BPF's sums; the wire and
    the aggregator's positions keep them apart from the collectives that had no record."""
    from argus import schema, wire
    from argus.aggregator.align import POSITIONS, JobAlign

    t = RankTracker(
        from_environ({"RANK": "3", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "j1"}, 7, "h"),
        libnccl.CommLayout("table", 8, 16, 20),
        coll_records=64,
    )
    feed_steps(t, 1, per_step=0)  # the communicator's creation: its sequence numbers count from 0
    stride = 1
    asked: list = []
    out: List[dict] = []
    n = 200
    for e in range(1, 8):
        base = 1_000_000 * (e + 1)
        first = (e - 1) * n
        for i in range(n):
            seq = first + i
            if seq % stride == (asked[0][2] if asked else 0):
                t.on_record(nccl_rec(e, 0xC0, seq, base + 100 * i))
        t.add_colls(
            CollKey(tgid=7, call=call_id("ncclAllReduce"), epoch=e, comm=0xC0, dtype=9),
            CollVal(
                count=n, elems=n * 1024, host_ns=n * 5000, first_seq=first, first_enter=base, last_exit=base
            ),
        )
        t.on_record(sync_rec(e, base + 500_000, base + 900_000))
        out += t.finalize(e + 1, 1_700_000_000 * 10**9)  # realtime - monotonic: the wire checks times
        new = t.take_samples()
        if new:
            asked, stride = new, new[0][1]
    assert asked == [(0xC0, 4, 0)]
    last = out[-1]
    key = f"{fnv1a64(bytes(range(128))):016x}"
    nccl = last["nccl"]
    assert nccl["ops"]["AllReduce"] == {"count": 200, "bytes": 200 * 1024 * 2, "host_ns": 200 * 5000}
    assert nccl["comms"][key]["collectives"] == 200
    seqs = [a[1] for a in nccl["arrivals"]]
    assert len(seqs) == 50 and all((s - seqs[0]) % 4 == 0 for s in seqs)
    assert last["step"] == seqs[0] // 200 and last["step_source"] == "nccl-seq"
    rs = schema.from_probe(last)
    c = rs.comms[key]
    assert (c.count, c.first_seq, c.collectives, len(c.seqs)) == (200, seqs[0], 200, 50)
    back = wire.decode_step(wire.encode_step(rs)).comms[key]
    assert (back.count, back.first_seq, back.seqs) == (200, seqs[0], c.seqs)
    ja = JobAlign()
    aligned = ja.add(rs) + ja.flush()
    assert aligned, "no summary out of the aligner"
    got = aligned[0].comms[key].seqs
    assert [p % POSITIONS for p in got] == list(range(0, 200, 4))


def test_tracker_identifies_a_communicator_from_process_memory() -> None:
    """A communicator created before attach: commHash, rank, nRanks through a table row (a key every
    rank shares); rank and nRanks only through the accessors (a key of this process); values that
    make no sense are never trusted."""
    comm = bytearray(64)
    struct.pack_into("<Qii", comm, 8, 0xABCDEF, 5, 16)
    t = _tracker_over(comm, libnccl.CommLayout("table", 8, 16, 20))
    t.on_record(nccl_rec(0, 0x99, 3, 100))
    info = t.comms[0x99]
    assert (info.hash, info.rank, info.nranks, info.source, info.shared) == (0xABCDEF, 5, 16, "table", True)
    t = _tracker_over(comm, libnccl.CommLayout("accessors", libnccl.OFF_UNKNOWN, 16, 20))
    t.on_record(nccl_rec(0, 0x99, 3, 100))
    info = t.comms[0x99]
    assert (info.hash, info.rank, info.nranks, info.source, info.shared) == (0x99, 5, 16, "accessors", False)
    struct.pack_into("<ii", comm, 16, 7, 3)  # rank 7 of 3: not a communicator this layout describes
    t = _tracker_over(comm, libnccl.CommLayout("table", 8, 16, 20))
    t.on_record(nccl_rec(0, 0x99, 3, 100))
    assert (t.comms[0x99].source, t.comms[0x99].nranks, t.identity_errors) == ("inferred", -1, 1)
    t = _tracker_over(comm, libnccl.UNKNOWN_LAYOUT)
    t.on_record(nccl_rec(0, 0x99, 3, 100))
    assert (t.comms[0x99].source, t.comms[0x99].hash) == ("inferred", 0x99)


def test_identity_from_launchers() -> None:
    torch = from_environ(
        {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "TORCHELASTIC_RUN_ID": "abc"}, 9, "n1"
    )
    assert (torch.rank, torch.local_rank, torch.world_size, torch.job, torch.source) == (
        5,
        1,
        16,
        "abc",
        "torchrun",
    )
    slurm = from_environ(
        {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NTASKS": "32", "SLURM_JOB_ID": "42"}, 9, "n"
    )
    assert (slurm.rank, slurm.world_size, slurm.job) == (7, 32, "slurm-42")
    flags = from_environ({"RANK": "5"}, 9, "n", job="mine", rank=2)
    assert (flags.rank, flags.job, flags.source) == (2, "mine", "flag")
    none = from_environ({}, 9, "n")
    assert (none.rank, none.job) == (-1, "pid-9")


def test_prologue_plans() -> None:
    assert plan_entry(b"\x55\x48\x89\xe5").fast and plan_entry(b"\x55").offset == 0
    p = plan_entry(b"\xf3\x0f\x1e\xfa\x41\x57")
    assert (p.offset, p.fast, p.insn) == (4, True, "push")
    assert plan_entry(b"\x0f\x1f\x44\x00\x00\x55").insn == "nop5"
    assert not plan_entry(b"\x48\x81\xec\x88\x00\x00\x00").fast  # sub $0x88,%rsp: single-stepped
    assert skippable("mov", "%rsi,%rax") and skippable("test", "%rdi,%rdi")
    assert not skippable("mov", "%ecx,%edi") and not skippable("sub", "$0x88,%rsp")
    assert not skippable("mov", "%rax,(%rdi)") and not skippable("call", "foo")


def test_elf_symbols_version_and_layout_of_the_simulated_nccl() -> None:
    libs = build()
    elf = Elf(libs.libnccl)
    assert {"ncclAllReduce", "ncclCommInitRank", "ncclGetVersion"} <= set(elf.symbols)
    assert libnccl.version_of(elf) == 22105
    lay = libnccl.layout_of(elf)  # decoded accessors, validated against the table's row for it
    assert (lay.source, lay.comm_hash, lay.rank, lay.nranks) == ("table", 8, 16, 20), lay.note
    assert "argusSimNcclMarker" not in elf.data_symbols  # nothing announces the layout
    cuda = Elf(libs.libcuda)
    sym = cuda.symbols["cuLaunchKernel"]
    assert cuda.read(sym.offset, 1) == b"\x55"  # push %rbp: the probe will be cheap
    assert libnccl.layout_of(cuda).source == "none"


def test_durations() -> None:
    assert parse_duration("500ms") == 0.5 and parse_duration("2m") == 120 and parse_duration("3") == 3
    with pytest.raises(click.BadParameter):
        parse_duration("soon")


def test_a_groups_wait_in_ncclgroupend_counts_as_its_last_operations() -> None:
    """Grouped send/recv only post; ncclGroupEnd runs them and, where they block, waits there for
    the peers. That time must show as the operations' host time (the aggregator's `wait:p2p`), not
    as the rank's own host time; an inner ncclGroupEnd says nothing."""
    from argus.agent.tracker import EpochData, _add_group_waits
    from argus.probes.records import NCCL_F_IN_GROUP

    def p2p(call: str, enter: int, exit_: int) -> RecNccl:
        r = RecNccl(comm=0xC1, seq=0, count=8, dtype=9, peer=1, flags=NCCL_F_IN_GROUP, enter_ns=enter)
        set_hdr(r, **hdr(5, call, 0, exit_))
        return r

    def end(enter: int, exit_: int, inner: bool = False) -> RecNccl:
        r = RecNccl(comm=0, seq=0, count=0, dtype=0xFF, peer=-1, flags=NCCL_F_IN_GROUP if inner else 0)
        r.enter_ns = enter
        set_hdr(r, **hdr(5, "ncclGroupEnd", 0, exit_))
        return r

    t = make_tracker()
    for r in (
        p2p("ncclSend", 100, 110),
        p2p("ncclRecv", 120, 130),
        end(140, 142, inner=True),
        end(150, 9_150),
    ):
        t.on_record(r)
    d = t.epochs[0]
    assert [g.enter_ns for g in d.group_ends] == [150]  # the outermost only
    out = t._nccl([d])
    waits = [a[5] for a in out["arrivals"]]
    assert waits == [10, 10 + 9_000], out["arrivals"]  # the last posted operation takes the wait
    assert out["ops"]["Send"]["count"] == 1 and "GroupEnd" not in out["ops"]
    # a group end with no operation of its thread before it changes nothing
    grouped = [(7, 100, [0, 0, "Send", 8, 100, 10])]
    _add_group_waits(grouped, [end(50, 90)])
    assert grouped[0][2][5] == 10
    assert isinstance(EpochData().group_ends, list)


def test_kernel_names_and_events_remembered_are_bounded() -> None:
    """A JIT loading kernels without end (or a hostile target) must not grow the agent for ever: past
    MAX_REMEMBERED the oldest are forgotten, the newest still named."""
    from argus.agent import tracker as tr

    t = make_tracker()
    n = tr.MAX_REMEMBERED + 1000
    for i in range(n):
        fn = RecFuncName(func=0x1000 + i, result=0, name=b"k%d" % i)
        set_hdr(fn, **hdr(2, "cuModuleGetFunction", 0, 11 + i))
        t.on_record(fn)
    assert len(t.func_names) == tr.MAX_REMEMBERED
    assert 0x1000 not in t.func_names and t.func_names[0x1000 + n - 1] == f"k{n - 1}"


def test_the_call_table_says_each_calls_channel_and_class() -> None:
    """Channels and classes come from the probe specs (argus/probes/base.py), never from names: every
    registered call has a channel, each spec's call has its channel's name and the spec's class, a
    per-thread-stream variant counts as its call, and the step marker is the `step` channel's."""
    from argus.agent.attach import ALL_CHANNELS
    from argus.agent.pysection import mark_key
    from argus.probes import base, libcuda
    from argus.probes.stepfn import STEP_MARKER

    assert all(base.CALL_CHANNELS), [n for n, c in zip(base.ALL_CALLS, base.CALL_CHANNELS) if not c]
    for ch in ALL_CHANNELS:
        for s in ch.specs:
            cid = call_id(s.prog)
            assert base.call_channel(cid) == ch.name, s.symbol
            assert base.call_class(cid) == s.cls, s.symbol
    assert base.call_channel(call_id(STEP_MARKER)) == "step"
    assert base.call_channel(10_000) == "" and base.call_class(10_000) == base.CALL
    assert set(libcuda.LAUNCH_CALLS) == {"cuLaunchKernel", "cuLaunchKernelEx", "cuGraphLaunch"}
    assert "cuMemcpyDtoH_v2" in libcuda.SYNC_CALLS and "cuMemcpyDtoHAsync_v2" not in libcuda.SYNC_CALLS
    # the keys of python.calls (docs/python.md), as before the table had classes
    keys = {n: mark_key(call_id(n)) for n in ("cuLaunchKernelEx", "cuGraphLaunch", "cuCtxSynchronize")}
    assert keys == {
        "cuLaunchKernelEx": "launches",
        "cuGraphLaunch": "other_calls",
        "cuCtxSynchronize": "syncs",
    }
    assert mark_key(call_id("ncclRecv")) == mark_key(call_id("ncclAllReduce")) == "collectives"
    assert mark_key(call_id("cuEventRecord")) == "event_records"


class _Key:
    def __init__(self, tgid: int, epoch: int) -> None:
        self.tgid, self.epoch = tgid, epoch

    def __repr__(self) -> str:
        return f"({self.tgid}, {self.epoch})"


def test_one_drain_hands_over_complete_epochs_once_and_deletes_them() -> None:
    """argus/agent/drain.py take(), the one drain of every channel's maps (the Python channel's too):
    epochs in [final_before, final) are handed over and deleted; older ones (late increments of an
    epoch already handed over) and those of processes no longer tracked are deleted unseen by `on`;
    newer ones stay for the next drain. `seen` sees every entry of a tracked process."""
    from argus.agent.drain import take

    keys = {
        (1, 3): _Key(1, 3),
        (1, 4): _Key(1, 4),
        (1, 5): _Key(1, 5),
        (1, 6): _Key(1, 6),
        (2, 0): _Key(2, 0),
    }
    tbl = {k: 1 for k in keys.values()}
    got: List[object] = []
    seen: List[object] = []
    take(
        tbl,
        {1: "p1"},
        final={1: 6},
        final_before={1: 4},
        on=lambda o, k, v: got.append((o, k.epoch, v)),
        seen=lambda o, k: seen.append(k.epoch),
    )
    assert got == [("p1", 4, 1), ("p1", 5, 1)]
    assert sorted(seen) == [3, 4, 5, 6]
    assert list(tbl) == [keys[(1, 6)]]


def test_no_tail_when_the_sections_hold_only_epochs_already_out() -> None:
    """A process that exits with nothing after its last step, while its Python section still holds
    epochs of before its first boundary (left out, never summarized): no tail (it raised IndexError
    on an empty list of epochs, seen under load in tests/test_probe.py's drops test)."""

    class Section:
        name = "python"

        def epochs(self) -> List[int]:
            return [0, 1]

    t = RankTracker(from_environ({}, 1, "h"))
    t.sections.append(Section())
    t.next_epoch = 5
    assert t.flush_tail() is None


def test_an_epoch_never_closed_keeps_a_bounded_number_of_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """No host sync ever closes the epoch (a job that never syncs, or `--no-cuda`): the records
    kept for it stop at the limit, the rest are counted in the process's drops, never silent."""
    from argus.agent import tracker as tr

    monkeypatch.setattr(tr, "MAX_EPOCH_RECORDS", 10)
    t = make_tracker()
    for i in range(15):
        t.on_record(nccl_rec(0, 0xC0, i, 1000 * (i + 1)))
    assert len(t.epochs[0].nccl) == 10
    assert t.drops_total == {tr.NOT_KEPT: 5}
    assert t.arrive.colls[0] and len(t.arrive.colls[0]) == 10  # the GPU-arrival side is bounded too


def test_exec_check_reads_the_mappings_only_when_the_auxiliary_vector_changed() -> None:
    """argus/agent/targets.py execed(): a PyTorch process's mappings run to thousands of lines, read
    every 2 s for every rank; they are compared only when /proc/PID/auxv changed (an exec with
    randomisation) or once a minute (an exec without)."""
    import subprocess
    import sys
    import time

    from argus.agent import targets as tg
    from argus.agent.attach import image_of

    # The child says when it runs its own code: until its exec is done it is a copy of this
    # interpreter, and during the exec its new address space fills (the vdso comes after the new
    # name): a loaded machine made either gap long enough to fail the first comparison.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = child.pid
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        t = tg.Target(pid, from_environ({}, pid, "h"), make_tracker(), {}, image=image_of(pid, {}))
        assert t.image  # the vdso at least
        now = time.monotonic()
        assert tg.execed({pid: t}, now) == []  # compared once: the same image
        assert t.auxv and t.image_checked == now
        real = t.image
        t.image = (("[vdso]", 1),)  # as if the image had moved: unseen while auxv is the same ...
        assert tg.execed({pid: t}, now + 2) == []
        assert tg.execed({pid: t}, now + tg.IMAGE_RECHECK_S + 1) == [pid]  # ... until the minute is up
        assert tg.execed({pid: t}, now + tg.IMAGE_RECHECK_S + 3) == []  # (checked 2 s ago)
        t.auxv = b"another program's"
        assert tg.execed({pid: t}, now + tg.IMAGE_RECHECK_S + 5) == [pid]  # auxv changed: at once
        t.image = real
        assert tg.execed({pid: t}, now + tg.IMAGE_RECHECK_S + 7) == []
    finally:
        child.kill()
        child.wait()


def test_an_epoch_still_open_after_many_collectives_is_sampled_then_sparser() -> None:
    """No epoch is final yet (the first steps after attach, or a job without host syncs): past
    8 x --coll-records collective records in the open epoch its busy communicator is sampled at
    once (every 8th of 256 seen), 8 x sparser past 64 x; the stride of the first final epoch with
    BPF's exact count replaces it, and a communicator already aligned to the steps is left alone."""
    from argus.probes.records import CollKey, CollVal

    t = RankTracker(from_environ({}, 7, "h"), libnccl.CommLayout("table", 8, 16, 20), coll_records=32)
    for seq in range(255):
        t.on_record(nccl_rec(1, 0xC0, seq, 1000 + seq))
    assert t.take_samples() == []
    t.on_record(nccl_rec(1, 0xC0, 255, 2000))
    assert t.take_samples() == [(0xC0, 8, 0)]  # 256 records of one communicator / 32
    for seq in range(256, 256 + 8 * 224):  # (BPF now records every 8th: the agent sees 1 in 8)
        if seq % 8 == 0:
            t.on_record(nccl_rec(1, 0xC0, seq, 3000 + seq))
    got = t.take_samples()
    assert got == [] and len(t.epochs[1].nccl) == 256 + 224
    for seq in range(2048 * 8, 2048 * 8 + 8 * (2048 - 480)):
        if seq % 8 == 0:
            t.on_record(nccl_rec(1, 0xC0, seq, 4000 + seq))
    assert t.take_samples() == [(0xC0, 64, 0)]  # at 2,048 records: 8 x sparser
    # the epoch closes: BPF's sums say 3,200 collectives in it -> every 100th
    t.add_colls(
        CollKey(tgid=7, call=call_id("ncclAllReduce"), epoch=1, comm=0xC0, dtype=9),
        CollVal(count=3200, elems=3200, host_ns=1, first_seq=0, first_enter=1000, last_exit=9000),
    )
    t.on_record(sync_rec(1, 10_000, 11_000))
    t.finalize(2, 0)
    assert t.take_samples() == [(0xC0, 100, 0)]
    # aligned to the steps (as _want_samples does): an open epoch's marks leave it alone
    t._provisional.discard(0xC0)
    for seq in range(256):
        t.on_record(nccl_rec(3, 0xC0, 10_000 + seq, 20_000 + seq))
    assert t.take_samples() == [] and t.sampled[0xC0] == (100, 0)
