"""GPU-arrival bounds from scripted record sequences (argus/agent/gpuarrive.py): the PyTorch
ProcessGroupNCCL pattern with and without timing, a caching allocator's queries, syncs and the
network proxy's first send. Pure: no BPF."""

from __future__ import annotations

from typing import Any, Dict, Optional

from argus.agent.gpuarrive import GpuArrival

C, N = 0xC0, 0xD0  # compute and NCCL streams


class Proc(GpuArrival):
    """A process's calls as the CUDA and NCCL channels report them: BPF counts every stream operation
    (argus.h `next_op`) and keeps each event's latest recording (cuda.bpf.c `ev_marks`); a recording
    is told only with what refers to it. Written from the probes' comments, to script the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.ev: Dict[int, tuple] = {}  # event -> (stream, place, time)
        self.skip_pos: Dict[str, int] = {}

    def _op(self) -> int:
        self.ops += 1
        return self.ops

    def record(self, event: int, stream: int, ts: int) -> None:
        self.ev[event] = (stream, self._op(), ts)

    def wait(self, stream: int, event: int, ts: int = 0) -> None:
        ms, mp, mt = self.ev.get(event, (0, 0, 0))
        self.on_stream_wait(stream, self._op(), ms, mp, mt, ts)

    def coll(self, epoch: int, comm: str, seq: int, stream: int, t: int, recorded: bool = True) -> None:
        pos = self._op()
        if not recorded:  # sampled out: summed in BPF, its place kept for the next record
            self.skip_pos[comm] = pos
            return
        self.on_collective(epoch, comm, seq, stream, pos, t, self.skip_pos.pop(comm, 0))

    def done(self, event: int, not_ready_ns: int, ts: int) -> None:
        stream, pos, rec = self.ev[event]
        self.on_event_done(stream, pos, rec, not_ready_ns, ts)

    def stream_sync(self, stream: int, enter_ns: int, exit_ns: int) -> None:
        self.on_stream_sync(stream, self._op(), enter_ns, exit_ns)

    def elapsed(self, start: int, end: int, ns: int, epoch: int) -> bool:
        (s0, p0, _), (s1, p1, _) = self.ev[start], self.ev[end]
        return self.on_elapsed(s0, p0, s1, p1, ns, epoch)


def collective(g: Proc, t: int, k: int, epoch: int = 0, timing: bool = True) -> Dict[str, int]:
    """One ProcessGroupNCCL collective at host time t: events pre/start/end of instance k."""
    pre, start, end = 0x1000 + k, 0x2000 + k, 0x3000 + k
    g.record(pre, C, t)
    g.wait(N, pre)
    if timing:
        g.record(start, N, t + 1)
    g.coll(epoch, "X", k, N, t + 2)
    g.record(end, N, t + 3)
    return {"pre": pre, "start": start, "end": end}


def bounds(out: Optional[Dict[str, Any]]) -> Dict[int, list]:
    assert out is not None
    return {row[0]: row[1:] for row in out["bounds"]["X"]}


def test_a_start_event_query_bounds_the_arrival_tightly() -> None:
    g = Proc()
    ev = collective(g, 100, 0)
    g.done(ev["start"], 150, 300)  # not passed at 150, passed by 300
    g.done(ev["end"], 310, 400)
    assert g.close_step([0], 7, 90) is None  # the evidence comes with the next step's summary
    out = g.close_step([1], 8, 500)
    assert out is not None and out["step"] == 7
    # the start event passed by 300 bounds it from above; its failed query at 150 says only that
    # the NCCL stream had not got there (it may have been busy with the collective before)
    assert bounds(out)[0] == [100, 300, "hq"]


def test_without_timing_only_the_end_event_bounds_it_and_says_so() -> None:
    g = Proc()
    ev = collective(g, 100, 0, timing=False)
    g.done(ev["end"], 310, 400)  # a failed query after the collective says nothing of its start
    g.close_step([0], 0, 90)
    assert bounds(g.close_step([1], 1, 500))[0] == [100, 400, "he"]


def test_the_compute_streams_marks_bound_it_from_below() -> None:
    """A caching allocator's failed query of a mark recorded before the pre-collective event: the
    compute stream had not got there, so neither had the collective."""
    g = Proc()
    g.record(0x77, C, 50)  # an allocator block freed on the compute stream
    ev = collective(g, 100, 0, timing=False)
    g.done(0x77, 180, 260)
    g.done(ev["end"], 0, 500)
    g.close_step([0], 0, 40)
    assert bounds(g.close_step([1], 1, 600))[0] == [180, 500, "qe"]


def test_the_compute_streams_later_marks_bound_it_from_above() -> None:
    """A caching allocator's successful query of a mark recorded on the compute stream after the
    pre-collective event: the compute had passed the collective's point by then, whatever the NCCL
    stream was still doing (the arrival a straggler is named by)."""
    g = Proc()
    g.record(0x70, C, 50)
    ev = collective(g, 100, 0, timing=False)
    g.record(0x71, C, 120)  # the next layer's block
    g.done(0x70, 90, 160)  # not passed at 90 (before the pre-collective event: a lower bound)
    g.done(0x71, 0, 210)  # passed by 210
    g.done(ev["end"], 0, 900)
    g.close_step([0], 0, 40)
    assert bounds(g.close_step([1], 1, 1000))[0] == [100, 210, "hq"]


def test_a_mark_before_the_wait_does_not_bound_it_from_above() -> None:
    """The previous collective's end event passed: that says nothing of this one, which also waits
    for its pre-collective event."""
    g = Proc()
    ev0 = collective(g, 100, 0, timing=False)
    collective(g, 200, 1, timing=False)
    g.done(ev0["end"], 0, 250)
    g.close_step([0], 0, 90)
    b = bounds(g.close_step([1], 1, 900))
    assert b[0] == [100, 250, "he"]
    assert b[1] == [200, 0, "h-"]


def test_stream_sync_and_elapsed_and_net_send() -> None:
    g = Proc()
    ev = collective(g, 100, 0)
    g.stream_sync(N, 120, 450)
    g.on_net_send(0, 210, 5)
    g.close_step([0], 3, 90)
    assert g.elapsed(ev["start"], ev["end"], 40_000, 1)  # read by the watchdog in the next step
    assert not g.elapsed(ev["pre"], ev["end"], 1, 1)  # two streams: a framework timer
    out = g.close_step([1], 4, 500)
    assert out is not None
    assert bounds(out)[0] == [100, 450, "hs"]
    assert out["net_first_ns"] == 210
    assert out["coll_gpu_ns"] == {"X": [40_000]}


def test_a_send_that_continues_an_earlier_collective_is_not_the_steps_first() -> None:
    g = Proc()
    collective(g, 100, 0)
    g.on_net_send(0, 210, 95)  # the send before it was inside this step: not its first
    g.close_step([0], 0, 90)
    out = g.close_step([1], 1, 500)
    assert out is not None and "net_first_ns" not in out


def test_elapsed_over_several_collectives_stays_a_timer() -> None:
    g = Proc()
    g.record(0x51, N, 10)
    collective(g, 100, 0, timing=False)
    collective(g, 200, 1, timing=False)
    g.record(0x52, N, 300)
    assert not g.elapsed(0x51, 0x52, 5, 0)


def test_a_stream_that_only_waits_keeps_a_bounded_list() -> None:
    """DDP's compute stream waits for every bucket's end event and runs no collective itself."""
    g = Proc()
    for k in range(10_000):
        g.record(0x9000 + k % 50, N, k)
        g.wait(C, 0x9000 + k % 50)
    assert len(g.waits[C]) <= 64


def test_at_tensor_parallel_rates_every_nth_instance_is_bounded() -> None:
    """200 collectives of one communicator in a step: every 4th (ceil(200 / MAX_BOUNDS)), the same
    indices on every member; a step of 24 keeps all of them."""
    from argus.agent.gpuarrive import MAX_BOUNDS

    g = Proc()
    evs = [collective(g, 100 + 10 * k, k, timing=False) for k in range(200)]
    for ev in evs:
        g.done(ev["end"], 0, 5000)
    g.close_step([0], 0, 90)
    got = sorted(bounds(g.close_step([1], 1, 6000)))
    stride = -(-200 // MAX_BOUNDS)
    assert got == list(range(0, 200, stride)) and len(got) <= MAX_BOUNDS
    g = Proc()
    evs = [collective(g, 100 + 10 * k, k, timing=False) for k in range(24)]
    for ev in evs:
        g.done(ev["end"], 0, 5000)
    g.close_step([0], 0, 90)
    assert sorted(bounds(g.close_step([1], 1, 6000))) == list(range(24))


def test_an_unrecorded_collective_between_keeps_a_mark_from_bounding_the_next() -> None:
    """Past the agent's collective records per step BPF records every n-th collective
    (nccl.bpf.c `coll_sample`): an end event recorded before an unrecorded collective is not right
    before the next recorded one, so it bounds that one only loosely. Indices are positions in the
    step (sequence number - the step's first) when BPF counted the step's collectives."""
    got = {}
    for skipped in (0, 1):
        g = Proc()
        g.coll(0, "X", 0, N, 100)
        g.record(0x3000, N, 103)  # the first collective's end event
        # with skipped=1, collective 1 entered at 150 without a record; this is collective 2
        if skipped:
            g.coll(0, "X", 1, N, 150, recorded=False)
        g.coll(0, "X", 1 + skipped, N, 200)
        g.record(0x3001, N, 203)
        g.done(0x3000, 0, 260)
        g.done(0x3001, 0, 400)
        g.close_step([0], 0, 90, {"X": (0, 2 + skipped)})
        got[skipped] = bounds(g.close_step([1], 1, 900))
    assert got[0][1] == [200, 260, "hq"]  # the end event right before it passed: tight
    assert got[1][2] == [200, 400, "he"]  # ... not right before it: only its own end bounds it
    assert sorted(got[1]) == [0, 2]  # positions in the step, whichever were recorded


def test_recordings_told_out_of_order_fall_in_their_places() -> None:
    """A recording is told when something refers to it (its completion, a wait): the allocator may
    query a later mark first. Places come from BPF, so the bounds are those of the in-order telling."""
    got = []
    for order in ((0x70, 0x71), (0x71, 0x70)):
        g = Proc()
        g.record(0x70, C, 50)
        ev = collective(g, 100, 0, timing=False)
        g.record(0x71, C, 120)
        for e in order:
            g.done(e, {0x70: 90, 0x71: 0}[e], {0x70: 160, 0x71: 210}[e])
        g.done(ev["end"], 0, 900)
        g.close_step([0], 0, 40)
        got.append(bounds(g.close_step([1], 1, 1000))[0])
    assert got[0] == got[1] == [100, 210, "hq"]


def test_timing_of_an_unrecorded_collective_is_not_a_framework_timer() -> None:
    """With TORCH_NCCL_ENABLE_TIMING every collective gets start/end events and the watchdog reads
    each one's elapsed time; past --coll-records only every n-th collective is recorded, and the
    reads of the others bracket no recorded collective: consumed, neither a timer nor a GPU time."""
    g = Proc()
    collective(g, 100, 0)
    ev1 = {"start": 0x2001, "end": 0x3001}
    g.record(0x1001, C, 200)
    g.wait(N, 0x1001)
    g.record(ev1["start"], N, 201)
    g.coll(0, "X", 1, N, 202, recorded=False)
    g.record(ev1["end"], N, 203)
    ev2 = collective(g, 300, 2)
    assert g.elapsed(ev1["start"], ev1["end"], 40_000, 1)  # the unrecorded one: not a timer
    assert g.elapsed(ev2["start"], ev2["end"], 30_000, 1)  # a recorded one: its GPU time
    assert g.coll_gpu == {1: {"X": [30_000]}}
    h = Proc()  # no collective sampled out on the stream: an empty interval stays a timer
    h.record(0x51, N, 10)
    collective(h, 100, 0, timing=False)
    h.record(0x52, N, 300)
    h.record(0x53, N, 310)
    assert not h.elapsed(0x52, 0x53, 5, 0)
