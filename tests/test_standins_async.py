"""The asynchronous variant of the stand-ins (tests/standins: cuda_async.c, nccl_async.c,
train_async.py): collectives enqueued on an NCCL stream, CUDA events, a DDP-like rank loop on two
simulated hosts, a network proxy calling ncclIbIsend. These tests check the variant itself from its
ground truth only (no BPF, no tracer)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest

from tests.standins.build import build
from tests.standins.job import StandinConfig, StandinJob

pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler (gcc)"),
    pytest.mark.timeout(120),
]

REPO = Path(__file__).resolve().parents[1]
RANKS, STEPS, STRAGGLER = 8, 6, 3
NOT_READY, INVALID_HANDLE = 600, 400


@pytest.fixture(scope="module")
def libdir() -> Path:
    return build(variant="async")


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """8 ranks on 2 hosts, rank 3's kernels 1.3x slower from the first step, NCCL timing on."""
    cfg = StandinConfig(
        variant="async",
        ranks=RANKS,
        steps=STEPS,
        nccl_timing=True,
        injects=[f"straggler:rank={STRAGGLER},factor=1.3"],
        run_dir=str(tmp_path_factory.mktemp("async-straggler")),
    )
    return StandinJob(cfg).start().wait(timeout=60)


def _section_types(path: Path) -> Set[int]:
    with open(path, "rb") as f:
        head = f.read(64)
        shoff = struct.unpack_from("<Q", head, 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(shoff)
        raw = f.read(shentsize * shnum)
    return {struct.unpack_from("<I", raw, i * shentsize + 4)[0] for i in range(shnum)}


def _dynamic_functions(lib: Path) -> Dict[str, int]:
    """Defined, global functions of .dynsym -> size, as `nm -D` (else readelf) lists them."""
    if shutil.which("nm"):
        out = subprocess.run(
            ["nm", "-D", "--defined-only", "-S", str(lib)], capture_output=True, text=True, check=True
        ).stdout
        funcs = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[2] == "T":
                funcs[parts[3].split("@")[0]] = int(parts[1], 16)
        return funcs
    if shutil.which("readelf"):
        out = subprocess.run(
            ["readelf", "--dyn-syms", "-W", str(lib)], capture_output=True, text=True, check=True
        ).stdout
        funcs = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 8 and parts[3] == "FUNC" and parts[4] == "GLOBAL" and parts[6] != "UND":
                funcs[parts[7].split("@")[0]] = int(parts[2], 0)
        return funcs
    pytest.skip("neither nm nor readelf is installed (binutils)")


def test_variant_builds_apart_and_exports_events_and_ncclIbIsend(libdir: Path) -> None:
    blocking = build()
    assert libdir != blocking and libdir.name.startswith("async-")
    cuda, nccl = libdir / "libcuda.so.1", libdir / "libnccl.so.2"
    for lib in (cuda, nccl):
        assert 2 not in _section_types(lib), f"{lib} has a .symtab (not stripped)"
    cfuncs, nfuncs = _dynamic_functions(cuda), _dynamic_functions(nccl)
    events = {
        "cuEventCreate",
        "cuEventRecord",
        "cuEventQuery",
        "cuEventSynchronize",
        "cuEventElapsedTime",
        "cuEventDestroy",
        "cuEventDestroy_v2",
        "cuStreamWaitEvent",
    }
    assert events <= set(cfuncs), events - set(cfuncs)
    assert {
        "cuLaunchKernel",
        "cuStreamSynchronize",
        "cuStreamCreateWithPriority",
        "standinStreamEnqueue",
    } <= set(cfuncs)
    assert "standinStreamWait" not in cfuncs
    assert {"ncclAllReduce", "ncclCommInitRank", "ncclCommGetAsyncError", "standinCollTimes"} <= set(nfuncs)
    assert nfuncs.get("ncclIbIsend", 0) > 0, "ncclIbIsend is not an exported function"
    # the blocking family is untouched: still no events
    assert not [s for s in _dynamic_functions(blocking / "libcuda.so.1") if s.startswith("cuEvent")]


# Run in a child: the two families both name themselves libcuda.so.1, and the stand-in NCCL finds
# its libcuda by soname among the libraries already loaded.
EVENT_PROBE = r"""
import ctypes, json, os, time
from tests.standins import train as base
from tests.standins.train_async import CollTimes, declare_async

cuda, nccl = base.load_libraries(os.environ["LIBDIR"])
declare_async(cuda, nccl)
vp, by = ctypes.c_void_p, ctypes.byref


def ok(rc):
    assert rc == 0, rc


ok(cuda.cuInit(0))
ctx = vp()
ok(cuda.cuCtxCreate_v2(by(ctx), 0, 0))
a, b, c = vp(), vp(), vp()
for s in (a, b, c):
    ok(cuda.cuStreamCreate(by(s), 1))
mod, f = vp(), vp()
ok(cuda.cuModuleLoadData(by(mod), b"standin-module v1\nkernel slow 1000\n"))
ok(cuda.cuModuleGetFunction(by(f), mod, b"slow"))


def launch(ms, s):  # 1000 ns per block
    ok(cuda.cuLaunchKernel(f, ms * 1000, 1, 1, 1, 1, 1, 0, s, None, None))


def event(flags=0):
    e = vp()
    ok(cuda.cuEventCreate(by(e), flags))
    return e


out, ms = {}, ctypes.c_float()
e, t0 = event(), event()
out["never_recorded"] = cuda.cuEventQuery(e)
ok(cuda.cuEventRecord(t0, a))
launch(300, a)
ok(cuda.cuEventRecord(e, a))
out["pending"] = cuda.cuEventQuery(e)
out["elapsed_pending"] = cuda.cuEventElapsedTime(by(ms), t0, e)
ok(cuda.cuStreamWaitEvent(b, e, 0))  # b waits for e as recorded now (behind the kernel)
g = event()
ok(cuda.cuEventRecord(g, b))
ok(cuda.cuEventRecord(e, c))  # re-recorded on an idle stream: queries see this one
ok(cuda.cuEventSynchronize(e))
out["rerecorded"] = cuda.cuEventQuery(e)
out["waiter_pending"] = cuda.cuEventQuery(g)
ok(cuda.cuEventSynchronize(g))
out["waiter_done"] = cuda.cuEventQuery(g)
out["pending_done"] = cuda.cuEventQuery(e)
end = event()
ok(cuda.cuEventRecord(end, a))
ok(cuda.cuEventSynchronize(end))
ok(cuda.cuEventElapsedTime(by(ms), t0, end))
out["elapsed_ms"] = ms.value
d = event(2)  # CU_EVENT_DISABLE_TIMING
ok(cuda.cuEventRecord(d, c))
ok(cuda.cuEventSynchronize(d))
out["elapsed_disabled"] = cuda.cuEventElapsedTime(by(ms), t0, d)
out["elapsed_unrecorded"] = cuda.cuEventElapsedTime(by(ms), t0, event())
launch(20, a)
h = event()
ok(cuda.cuEventRecord(h, a))
ok(cuda.cuEventDestroy_v2(h))  # destroyed while pending: the recording still completes
ok(cuda.cuStreamSynchronize(a))

# a world of 1: ncclAllReduce enqueues behind a 100 ms kernel and returns at once
uid, comm = base.UniqueId(), vp()
ok(nccl.ncclGetUniqueId(by(uid)))
ok(nccl.ncclCommInitRank(by(comm), 1, uid, 0))
buf = ctypes.c_uint64()
ok(cuda.cuMemAlloc_v2(by(buf), 4096))
launch(100, a)
t = time.time_ns()
ok(nccl.ncclAllReduce(buf.value, buf.value, 1024, 7, 0, comm, a))
out["enqueue_ns"] = time.time_ns() - t
ct = CollTimes()
ok(nccl.standinCollTimes(comm, 1, by(ct)))
out["state_enqueued"] = ct.state
ok(cuda.cuStreamSynchronize(a))
ok(nccl.standinCollTimes(comm, 1, by(ct)))
out["state_synced"] = ct.state
out["arrive_after_enqueue_ms"] = (ct.arrive_ns - ct.enqueue_ns) / 1e6
out["isend_calls"] = ct.isend_calls
err = ctypes.c_int(-1)
ok(nccl.ncclCommGetAsyncError(comm, by(err)))
out["async_error"] = err.value
ok(nccl.ncclCommDestroy(comm))
print(json.dumps(out))
"""


def test_event_semantics_follow_the_driver_reference(libdir: Path) -> None:
    env = dict(os.environ, LIBDIR=str(libdir), PYTHONPATH=str(REPO))
    env.pop("ARGUS_HOST", None)
    r = subprocess.run(
        [sys.executable, "-c", EVENT_PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["never_recorded"] == 0  # an event never recorded is an empty set of work
    assert out["pending"] == NOT_READY and out["elapsed_pending"] == NOT_READY
    assert out["rerecorded"] == 0  # queries see the most recent recording
    assert out["waiter_pending"] == NOT_READY  # a wait keeps the recording it captured
    assert out["waiter_done"] == 0 and out["pending_done"] == 0
    assert 280 < out["elapsed_ms"] < 400, out
    assert out["elapsed_disabled"] == INVALID_HANDLE and out["elapsed_unrecorded"] == INVALID_HANDLE
    # NCCL: enqueued, returned at once, reached by the stream after the kernel
    assert out["enqueue_ns"] < 5e6 and out["state_enqueued"] == 0, out
    assert out["state_synced"] == 2 and out["arrive_after_enqueue_ms"] > 80, out
    assert out["isend_calls"] == 0 and out["async_error"] == 0  # one host: no network


def test_job_runs_on_two_hosts(truth: Dict[str, Any]) -> None:
    assert truth["variant"] == "async" and truth["done"] == list(range(RANKS)), truth["errors"]
    assert set(truth["returncodes"].values()) == {0}
    assert truth["hosts"] == {r: f"standin-host{r // 4}" for r in range(RANKS)}
    for r in range(RANKS):
        assert [s for s, _, _ in truth["step_times"][r]] == list(range(STEPS))
        assert truth["comms"][r] == [{"name": "dp", "nranks": 8, "rank": r, "members": list(range(8))}]
        colls = truth["collectives"][r]
        assert [(c["step"], c["bucket"], c["seq"]) for c in colls] == [
            (s, b, 4 * s + b + 1) for s in range(STEPS) for b in range(4)
        ]
        assert all(c["state"] == "done" for c in colls)


def _colls(truth: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [c for r in range(RANKS) for c in truth["collectives"][r]]


def test_collectives_return_at_once_on_the_host(truth: Dict[str, Any]) -> None:
    colls = _colls(truth)
    host = [c["host_exit_ns"] - c["host_enter_ns"] for c in colls]
    gpu = [c["gpu_end_ns"] - c["gpu_arrive_ns"] for c in colls]
    assert statistics.median(gpu) > 5e6  # the transfer between hosts alone is ~6 ms
    assert statistics.median(host) < 0.01 * statistics.median(gpu), (statistics.median(host), gpu[:4])
    assert sum(h < 0.1 * g for h, g in zip(host, gpu)) >= 0.95 * len(colls)
    # the host ran ahead: it had returned before its stream even reached the collective
    assert sum(c["host_exit_ns"] < c["gpu_arrive_ns"] for c in colls) >= 0.9 * len(colls)


def test_the_slow_gpu_arrives_last(truth: Dict[str, Any]) -> None:
    by_rank = truth["collectives"]
    n = len(by_rank[0])
    latest = [max(range(RANKS), key=lambda r: by_rank[r][i]["gpu_arrive_ns"]) for i in range(n)]
    assert latest.count(STRAGGLER) >= 0.8 * n, latest
    # and its peers waited for it on the GPU: every member's transfer began at its arrival
    for i in range(n):
        start = {by_rank[r][i]["gpu_start_ns"] for r in range(RANKS)}
        assert max(start) - min(start) < 2e6, start
        assert abs(by_rank[STRAGGLER][i]["gpu_start_ns"] - by_rank[STRAGGLER][i]["gpu_arrive_ns"]) < 2e6


def test_the_proxy_sends_the_first_chunk_when_the_stream_arrives(truth: Dict[str, Any]) -> None:
    colls = _colls(truth)
    assert all(c["isend_calls"] == 8 for c in colls), {c["isend_calls"] for c in colls}
    lag = [c["first_isend_ns"] - c["gpu_arrive_ns"] for c in colls]
    assert min(lag) >= 0 and statistics.median(lag) < 2e6, sorted(lag)[-5:]


def test_watchdog_polls_events_and_times_the_collectives(truth: Dict[str, Any]) -> None:
    for r in range(RANKS):
        works = {(w["step"], w["bucket"]): w for w in truth["works"][r]}
        assert len(works) == STEPS * 4
        for c in truth["collectives"][r]:
            w = works[(c["step"], c["bucket"])]
            # the start event is recorded right before the collective on the NCCL stream
            assert w["elapsed_ms"] == pytest.approx((c["gpu_end_ns"] - c["gpu_arrive_ns"]) / 1e6, abs=1.5)
    # cuEventQuery answered 600 (CUDA_ERROR_NOT_READY) for a work, then 0 once it was done
    assert any(0 < w["not_ready"] < w["queries"] for r in range(RANKS) for w in truth["works"][r])


def test_one_host_makes_no_network_calls(tmp_path: Path) -> None:
    cfg = StandinConfig(variant="async", ranks=4, steps=2, ranks_per_host=4, run_dir=str(tmp_path))
    t = StandinJob(cfg).start().wait(timeout=60)
    assert t["done"] == [0, 1, 2, 3] and set(t["hosts"].values()) == {"standin-host0"}
    colls = [c for r in range(4) for c in t["collectives"][r]]
    assert len(colls) == 4 * 2 * 4
    assert all(c["isend_calls"] == 0 and c["first_isend_ns"] is None for c in colls)
    assert all(w["elapsed_ms"] is None for r in range(4) for w in t["works"][r])  # timing off


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        StandinJob(StandinConfig(variant="nope"))
    with pytest.raises(ValueError, match="layout dp only"):
        StandinJob(StandinConfig(variant="async", layout="pp-dp"))
    with pytest.raises(ValueError, match="ranks_per_host"):
        StandinJob(StandinConfig(variant="async", ranks_per_host=0))
