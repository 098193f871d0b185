"""One rank of the asynchronous variant (cuda_async.c / nccl_async.c): a stand-in for stock PyTorch
DDP over ProcessGroupNCCL, written from PyTorch's public docs and ProcessGroupNCCL's behaviour as
documented (TORCH_NCCL_* variables), not from any tracer or simulator.

Layout `dp` only. What the GPU-facing calls look like, per step:

  data        8 ms host sleep, HtoD copy of the batch on the compute stream
  forward     kernels on the compute stream, which is the legacy default stream (NULL), as in
              PyTorch unless a script picks another stream
  backward    kernels; each time a gradient bucket is ready (DDP's reducer), ProcessGroupNCCL's
              allreduce does:
                cuEventRecord(pre, compute)             pre: one event per communicator, reused
                cuStreamWaitEvent(nccl_stream, pre, 0)  (syncStream)
                [TORCH_NCCL_ENABLE_TIMING=1: cuEventRecord(start, nccl_stream)]
                ncclAllReduce(..., nccl_stream)         enqueues and returns at once
                cuEventRecord(end, nccl_stream)
              and hands the work to the watchdog
  wait        work.wait() of the last bucket: cuStreamWaitEvent(compute, end, 0)
  optimizer   kernels, then loss.item(): a 4-byte DtoH copy + cuStreamSynchronize(compute)

With STANDIN_LAUNCH_BOUND=1 the job is launch-bound: each layer kernel goes as LAUNCH_SPLIT launches
(~330 a step, past the 48 a stream holds with STANDIN_LAUNCH_QUEUE=48: launches then wait for
the GPU) and a caching allocator's events are recorded at each layer's end and queried, oldest
first, before the next.

No framework timers. A watchdog thread wakes every 100 ms and, per pending work, calls
ncclCommGetAsyncError, cuEventQuery(start) (with timing) and cuEventQuery(end); once end is done it
computes cuEventElapsedTime(start, end) (with timing) and retires the work, returning its events to
a cache (events are created on first use and reused, as PyTorch's event cache does). An async NCCL
error tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, the default).

The rank is train.py's `Rank` with its hooks filled in (streams, the all-reduce, work.wait(), the
extra truth fields, the watchdog's start and stop, the events' destruction); the command line,
the fault specs and the rest of the step are train.py's.

Truth (rank<R>.jsonl), as train.py writes it, plus in each `step` line `colls`: per all-reduce the
host's time around ncclAllReduce and what the library saw (CLOCK_REALTIME ns): gpu_arrive_ns (this
rank's NCCL stream worker reached it), gpu_start_ns (every member's had), gpu_end_ns,
first_isend_ns (the proxy's first ncclIbIsend for it; None within one host) and isend_calls; and
one `work` line per work the watchdog retired (queries, not_ready, elapsed_ms).

  STANDIN_LIBDIR=$(python -m tests.standins.build --variant async) RANK=0 WORLD_SIZE=1 \
      python train_async.py --steps 3
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Any, Deque, Dict, List, Optional, Tuple

try:
    from tests.standins import train as base
except ImportError:  # run by path (job.py does): this file's directory is on sys.path
    import train as base  # type: ignore[no-redef]

CUDA_ERROR_NOT_READY = 600
CU_EVENT_DEFAULT, CU_EVENT_DISABLE_TIMING = 0x0, 0x2
CU_STREAM_NON_BLOCKING = 0x1
WATCHDOG_S = 0.1  # ProcessGroupNCCL's watchdog poll interval
# STANDIN_LAUNCH_BOUND=1: each layer kernel is launched as this many (unfused elementwise work), so
# a step launches ~330 kernels, past the 48 a stream of this driver then holds (job.py sets
# STANDIN_LAUNCH_QUEUE): the host waits in launches for its GPU, as a launch-bound job does, two
# layers ahead of it (a real one: ~1,024 launches, a few of its 32-80 layers; here a deeper queue
# would hold the whole 8-layer forward, and more launches a step need more CPU than 8 ranks' stream
# workers leave a 2-core machine)
LAUNCH_SPLIT = 4


class CollTimes(ctypes.Structure):
    """struct standin_coll_times (nccl_async.c)."""

    _fields_ = [
        ("seq", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("enqueue_ns", ctypes.c_uint64),
        ("arrive_ns", ctypes.c_uint64),
        ("start_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        ("first_isend_ns", ctypes.c_uint64),
        ("isend_calls", ctypes.c_uint32),
        ("state", ctypes.c_int32),
    ]


def declare_async(cuda: ctypes.CDLL, nccl: ctypes.CDLL) -> None:
    """Argument types of what the variant adds to the libraries."""
    vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
    cuda.cuEventCreate.argtypes = [ctypes.POINTER(vp), u]
    cuda.cuEventRecord.argtypes = [vp, vp]
    cuda.cuEventQuery.argtypes = [vp]
    cuda.cuEventSynchronize.argtypes = [vp]
    cuda.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
    cuda.cuEventDestroy_v2.argtypes = [vp]
    cuda.cuStreamWaitEvent.argtypes = [vp, vp, u]
    cuda.cuStreamCreateWithPriority.argtypes = [ctypes.POINTER(vp), u, i]
    cuda.cuCtxGetStreamPriorityRange.argtypes = [ctypes.POINTER(i), ctypes.POINTER(i)]
    cuda.cuCtxSetCurrent.argtypes = [vp]
    nccl.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(i)]
    nccl.standinCollTimes.argtypes = [vp, ctypes.c_uint64, ctypes.POINTER(CollTimes)]


@dataclass
class Work:
    """One ProcessGroupNCCL work: a collective and its events."""

    step: int
    bucket: int
    comm: base.Comm
    seq: int
    start: Optional[ctypes.c_void_p]
    end: ctypes.c_void_p
    queries: int = 0
    not_ready: int = 0


class AsyncRank(base.Rank):
    def __init__(self, args: argparse.Namespace, truth: IO[str]) -> None:
        self._wlock = threading.Lock()  # the main thread and the watchdog both write truth lines
        super().__init__(args, truth)
        if self.layout != "dp":
            raise SystemExit("the async variant runs layout dp only")
        declare_async(self.cuda, self.nccl)
        self.timing = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") not in ("", "0")
        self.high_priority = os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "0") not in ("", "0")
        self.host = os.environ.get("ARGUS_HOST", "")
        self.works_lock = threading.Lock()
        self.pending: List[Work] = []
        self.event_cache: Dict[int, List[ctypes.c_void_p]] = {}  # flags -> free events
        self.all_events: List[ctypes.c_void_p] = []
        self.sync_events: Dict[str, ctypes.c_void_p] = {}  # ncclEvents_: one per communicator
        self.coll_seq: Dict[str, int] = {}
        self.step_colls: List[Dict[str, Any]] = []
        self.stop_watchdog = threading.Event()
        self.dog: Optional[threading.Thread] = None
        self.last_end: Optional[ctypes.c_void_p] = None  # the end event of the last bucket's work
        self.launch_bound = os.environ.get("STANDIN_LAUNCH_BOUND", "0") not in ("", "0")
        # a caching allocator's events: a layer's blocks, freed after use on the compute stream,
        # come back only once the event recorded at the free has completed (checked oldest first
        # before the next layer allocates)
        self.freed: Deque[ctypes.c_void_p] = deque()

    def write(self, **fields: Any) -> None:
        with self._wlock:
            super().write(**fields)

    # -------------------------------------------------------------------- setup

    def create_streams(self) -> None:
        self.stream = ctypes.c_void_p(None)  # compute: the legacy default stream
        least, greatest = ctypes.c_int(), ctypes.c_int()
        self.cu("cuCtxGetStreamPriorityRange", ctypes.byref(least), ctypes.byref(greatest))
        self.nccl_stream = ctypes.c_void_p()  # getStreamFromPool(isHighPriority)
        prio = greatest.value if self.high_priority else least.value
        self.cu("cuStreamCreateWithPriority", ctypes.byref(self.nccl_stream), CU_STREAM_NON_BLOCKING, prio)

    # -------------------------------------------------------------------- events

    def take_event(self, flags: int) -> ctypes.c_void_p:
        """From the cache, else a new one (created on first use, as CUDAEvent does)."""
        with self.works_lock:
            free = self.event_cache.setdefault(flags, [])
            if free:
                return free.pop()
        ev = ctypes.c_void_p()
        self.cu("cuEventCreate", ctypes.byref(ev), flags)
        self.all_events.append(ev)
        return ev

    def sync_event(self, comm: base.Comm) -> ctypes.c_void_p:
        ev = self.sync_events.get(comm.name)
        if ev is None:
            ev = ctypes.c_void_p()
            self.cu("cuEventCreate", ctypes.byref(ev), CU_EVENT_DISABLE_TIMING)
            self.sync_events[comm.name] = ev
        return ev

    # -------------------------------------------------------------------- work

    def layer_fwd(self, share: int = 1) -> None:
        if self.launch_bound:
            self.layer(base.LAYER_FWD, share)
        else:
            super().layer_fwd(share)

    def layer_bwd(self, share: int = 1) -> None:
        if self.launch_bound:
            self.layer(base.LAYER_BWD, share)
        else:
            super().layer_bwd(share)

    def layer(self, kernels: Tuple[Tuple[str, int], ...], share: int) -> None:
        """A launch-bound layer: allocate (reclaiming freed blocks whose events completed), launch
        each kernel in LAUNCH_SPLIT pieces, free the layer's blocks with an event on the stream."""
        while self.freed:
            rc = self.cuda.cuEventQuery(self.freed[0])
            if rc == CUDA_ERROR_NOT_READY:
                break
            if rc != 0:
                raise base.CudaError("cuEventQuery", rc, "?")
            self.release_event(CU_EVENT_DISABLE_TIMING, self.freed.popleft())
        for k, blocks in kernels:
            for _ in range(LAUNCH_SPLIT):
                self.launch(k, blocks // share // LAUNCH_SPLIT)
        ev = self.take_event(CU_EVENT_DISABLE_TIMING)
        self.cu("cuEventRecord", ev, self.stream)
        self.freed.append(ev)

    def release_event(self, flags: int, ev: ctypes.c_void_p) -> None:
        with self.works_lock:
            self.event_cache.setdefault(flags, []).append(ev)

    def allreduce(self, comm: base.Comm, buf: int, bucket: int) -> None:
        """ProcessGroupNCCL::allreduce as the GPU-facing calls go; the work's end event becomes
        `last_end`."""
        if bucket == 0:
            self.maybe_hang()
        pre = self.sync_event(comm)
        self.cu("cuEventRecord", pre, self.stream)
        self.cu("cuStreamWaitEvent", self.nccl_stream, pre, 0)
        start = None
        if self.timing:
            start = self.take_event(CU_EVENT_DEFAULT)
            self.cu("cuEventRecord", start, self.nccl_stream)
        t0 = time.time_ns()
        self.nc(
            "ncclAllReduce",
            buf,
            buf,
            base.BUCKET_ELEMS,
            base.NCCL_FLOAT32,
            base.NCCL_SUM,
            comm.handle,
            self.nccl_stream,
        )
        t1 = time.time_ns()
        end = self.take_event(CU_EVENT_DEFAULT if self.timing else CU_EVENT_DISABLE_TIMING)
        self.cu("cuEventRecord", end, self.nccl_stream)
        seq = self.coll_seq[comm.name] = self.coll_seq.get(comm.name, 0) + 1
        with self.works_lock:
            self.pending.append(Work(self.step, bucket, comm, seq, start, end))
        self.step_colls.append(
            {"comm": comm.name, "seq": seq, "bucket": bucket, "host_enter_ns": t0, "host_exit_ns": t1}
        )
        self.last_end = end

    def wait_for_grads(self) -> None:
        """work.wait() of the last bucket: the compute stream waits for its end event."""
        assert self.last_end is not None
        self.cu("cuStreamWaitEvent", self.stream, self.last_end, 0)
        self.last_end = None

    def coll_truth(self) -> List[Dict[str, Any]]:
        """This step's collectives with the library's times (all done: the step synced on them)."""
        out = []
        for c in self.step_colls:
            t = CollTimes()
            rc = self.nccl.standinCollTimes(self.comms[c["comm"]].handle, c["seq"], ctypes.byref(t))
            d = dict(c)
            if rc == 0:
                d.update(
                    bytes=t.bytes,
                    gpu_arrive_ns=t.arrive_ns or None,
                    gpu_start_ns=t.start_ns or None,
                    gpu_end_ns=t.end_ns or None,
                    first_isend_ns=t.first_isend_ns or None,
                    isend_calls=t.isend_calls,
                    state=("enqueued", "running", "done", "failed")[t.state],
                )
            out.append(d)
        self.step_colls = []
        return out

    # -------------------------------------------------------------------- watchdog

    def watchdog(self) -> None:
        try:
            self.cu("cuCtxSetCurrent", self.ctx)
            while not self.stop_watchdog.wait(WATCHDOG_S):
                self.watch_once()
        except (base.CudaError, base.NcclError) as e:
            self.fail(e.call, e.code, str(e))

    def watch_once(self) -> None:
        with self.works_lock:
            works = list(self.pending)
        retired: List[Tuple[Work, Optional[float]]] = []
        for w in works:
            err = ctypes.c_int()
            self.nc("ncclCommGetAsyncError", w.comm.handle, ctypes.byref(err))
            if err.value != 0:
                text = self.nccl.ncclGetErrorString(err.value).decode()
                self.fail("ncclCommGetAsyncError", err.value, f"NCCL async error {err.value} ({text})")
            if w.start is not None:
                self.cuda.cuEventQuery(w.start)  # isStarted()
            rc = self.cuda.cuEventQuery(w.end)
            w.queries += 1
            if rc == CUDA_ERROR_NOT_READY:
                w.not_ready += 1
                continue
            if rc != 0:
                raise base.CudaError("cuEventQuery", rc, "?")
            elapsed = None
            if w.start is not None:
                ms = ctypes.c_float()
                self.cu("cuEventElapsedTime", ctypes.byref(ms), w.start, w.end)
                elapsed = round(ms.value, 4)
            retired.append((w, elapsed))
        if not retired:
            return
        with self.works_lock:
            for w, _ in retired:
                self.pending.remove(w)
                for ev, flags in ((w.start, CU_EVENT_DEFAULT), (w.end, self.end_flags)):
                    if ev is not None:
                        self.event_cache.setdefault(flags, []).append(ev)
        for w, elapsed in retired:
            self.write(
                kind="work",
                step=w.step,
                comm=w.comm.name,
                seq=w.seq,
                bucket=w.bucket,
                queries=w.queries,
                not_ready=w.not_ready,
                elapsed_ms=elapsed,
                retired_mono_ns=time.monotonic_ns(),
            )

    @property
    def end_flags(self) -> int:
        return CU_EVENT_DEFAULT if self.timing else CU_EVENT_DISABLE_TIMING

    def fail(self, call: str, code: int, message: str) -> None:
        """Tear the process down, as TORCH_NCCL_ASYNC_ERROR_HANDLING=3 does."""
        print(f"rank {self.rank}: watchdog: {message}", file=sys.stderr)
        self.write_error(call, code, message)
        os._exit(3)

    # -------------------------------------------------------------------- hooks of the step loop

    def meta_extra(self) -> Dict[str, Any]:
        return {"variant": "async", "host": self.host, "nccl_timing": self.timing}

    def step_extra(self) -> Dict[str, Any]:
        return {"colls": self.coll_truth()}

    def before_steps(self) -> None:
        self.dog = threading.Thread(target=self.watchdog, name="pg-nccl-watchdog", daemon=True)
        self.dog.start()

    def after_steps(self) -> None:
        deadline = time.monotonic() + 1.0  # let the watchdog retire the last step's works
        while time.monotonic() < deadline:
            with self.works_lock:
                if not self.pending:
                    break
            time.sleep(0.02)
        self.stop_watchdog.set()
        if self.dog is not None:
            self.dog.join()

    def teardown(self) -> None:
        for ev in [*self.all_events, *self.sync_events.values()]:
            self.cu("cuEventDestroy_v2", ev)


def main(argv: Optional[List[str]] = None) -> int:
    return base.run_rank(argv, AsyncRank, "one rank of a stand-in job (async variant, DDP-like)", ("dp",))


if __name__ == "__main__":
    sys.exit(main())
