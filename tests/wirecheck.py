"""What "equal up to the documented quantisation" means for a RankStep that went through argus.wire."""

from __future__ import annotations

from argus.schema import RankStep
from argus.wire import ARRIVAL_ABS_ERROR_NS, HOST_REL_ERROR

EXACT = (
    "job rank host pid step start_ns duration_ns local_rank world_size step_source clock_offset_ns "
    "clock_uncertainty_ns sync_count sync_wait_ns phases phase_stream py_phases launches launches_sampled "
    "kernels memcpy errors drops gpu version"
).split()


def _host_close(got: int, want: int) -> bool:
    return abs(got - max(want, 1)) <= HOST_REL_ERROR * max(want, 1) + 1


def assert_equivalent(got: RankStep, want: RankStep) -> None:
    """`got` (decoded) equals `want` (original) up to the quantisation documented in argus.wire."""
    for name in EXACT:
        assert getattr(got, name) == getattr(want, name), (name, getattr(got, name), getattr(want, name))
    assert got.comms.keys() == want.comms.keys()
    for cid, w in want.comms.items():
        g = got.comms[cid]
        assert (g.comm, g.nranks, g.rank, g.identity) == (w.comm, w.nranks, w.rank, w.identity)
        assert (g.seqs, g.ops, g.nbytes) == (w.seqs, w.ops, w.nbytes)
        assert len(g.arrive_ns) == len(w.arrive_ns)
        assert all(abs(a - b) <= ARRIVAL_ABS_ERROR_NS for a, b in zip(g.arrive_ns, w.arrive_ns))
        assert all(_host_close(a, b) for a, b in zip(g.host_ns, w.host_ns)), (g.host_ns, w.host_ns)
        assert len(g.p2p) == len(w.p2p)
        for gp, wp in zip(g.p2p, w.p2p):
            assert (gp.op, gp.peer, gp.nbytes) == (wp.op, wp.peer, wp.nbytes)
            assert abs(gp.arrive_ns - wp.arrive_ns) <= ARRIVAL_ABS_ERROR_NS
            assert _host_close(gp.host_ns, wp.host_ns)
    _gpu_arrival_close(got, want)


def _gpu_arrival_close(got: RankStep, want: RankStep) -> None:
    """GPU-arrival times travel as µs offsets: ≤ 500 ns off; everything else exact."""
    g, w = got.gpu_arrival, want.gpu_arrival
    assert (g is None) == (w is None), (g, w)
    if g is None or w is None:
        return
    assert g.step == w.step and g.coll_gpu_ns == w.coll_gpu_ns
    assert abs(g.net_first_ns - w.net_first_ns) <= ARRIVAL_ABS_ERROR_NS
    assert g.bounds.keys() == w.bounds.keys()
    for comm, rows in w.bounds.items():
        assert len(g.bounds[comm]) == len(rows)
        for (gi, glo, ghi, gs), (wi, wlo, whi, ws) in zip(g.bounds[comm], rows):
            assert (gi, gs) == (wi, ws) and abs(glo - wlo) <= ARRIVAL_ABS_ERROR_NS
            assert (ghi == 0) == (whi == 0) and abs(ghi - whi) <= ARRIVAL_ABS_ERROR_NS
