"""ctypes bindings to the simulated libcuda.so.1 and libnccl.so.2, used by the simulated trainer.

Every call goes through the real exported symbol, so uprobes see exactly what a framework
would issue. Errors raise `GpuError` with the library's own error string.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    POINTER,
    byref,
    c_char_p,
    c_double,
    c_float,
    c_int,
    c_int64,
    c_size_t,
    c_uint,
    c_uint64,
    c_void_p,
)
from typing import Any, List, Optional, Tuple

from argus.sim.build import SimLibs, build

CUDA_ERROR_NOT_READY = 600
CU_EVENT_DISABLE_TIMING = 0x2
# ncclDataType_t, ncclRedOp_t (nccl.h)
NCCL_DTYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
DTYPE_SIZE = {
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
}
NCCL_SUM = 0


class GpuError(RuntimeError):
    def __init__(self, lib: str, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: {text} ({lib} error {code})")
        self.code = code


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Cuda:
    """The driver API subset the trainer uses (real names and signatures)."""

    def __init__(self, libs: SimLibs | None = None) -> None:
        libs = libs or build()
        self.lib = ctypes.CDLL(str(libs.libcuda), mode=ctypes.RTLD_GLOBAL)
        L = self.lib
        for name in (
            "cuInit",
            "cuDeviceGet",
            "cuDevicePrimaryCtxRetain",
            "cuCtxSetCurrent",
            "cuCtxSynchronize",
            "cuModuleLoadData",
            "cuModuleGetFunction",
            "cuLaunchKernel",
            "cuMemAlloc_v2",
            "cuMemFree_v2",
            "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2",
            "cuMemcpyHtoD_v2",
            "cuMemcpyDtoH_v2",
            "cuStreamCreate",
            "cuStreamSynchronize",
            "cuStreamWaitEvent",
            "cuEventCreate",
            "cuEventRecord",
            "cuEventQuery",
            "cuEventSynchronize",
            "cuEventElapsedTime",
            "cuGetErrorString",
        ):
            getattr(L, name).restype = c_int
        L.cuLaunchKernel.argtypes = [
            c_void_p,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_void_p,
            c_void_p,
            c_void_p,
        ]
        L.cuMemcpyHtoDAsync_v2.argtypes = [c_uint64, c_void_p, c_size_t, c_void_p]
        L.cuMemcpyDtoHAsync_v2.argtypes = [c_void_p, c_uint64, c_size_t, c_void_p]
        L.cuMemcpyDtoH_v2.argtypes = [c_void_p, c_uint64, c_size_t]
        L.cuMemcpyHtoD_v2.argtypes = [c_uint64, c_void_p, c_size_t]
        L.cuMemFree_v2.argtypes = [c_uint64]
        L.cuStreamSynchronize.argtypes = [c_void_p]
        L.cuStreamWaitEvent.argtypes = [c_void_p, c_void_p, c_uint]
        L.cuEventRecord.argtypes = [c_void_p, c_void_p]
        L.cuEventQuery.argtypes = [c_void_p]
        L.cuEventSynchronize.argtypes = [c_void_p]
        L.cuEventElapsedTime.argtypes = [POINTER(c_float), c_void_p, c_void_p]
        L.cuModuleGetFunction.argtypes = [POINTER(c_void_p), c_void_p, c_char_p]
        L.cuModuleLoadData.argtypes = [POINTER(c_void_p), c_char_p]
        L.argusSimNow.restype = ctypes.c_int64
        L.argusSimSyncEpoch.restype = c_uint64
        L.argusSimNotReadyCount.argtypes = [c_uint64, c_uint64]
        L.argusSimNotReadyCount.restype = c_uint64
        L.argusSimLastSync.argtypes = [POINTER(c_int64), POINTER(c_int64)]
        L.argusSimLastSync.restype = None
        self._host_buf = ctypes.create_string_buffer(1 << 16)

    def check(self, call: str, rc: int) -> int:
        if rc != 0:
            s = c_char_p()
            self.lib.cuGetErrorString(rc, byref(s))
            raise GpuError("CUDA", call, rc, (s.value or b"unknown").decode())
        return rc

    def now(self) -> int:
        return int(self.lib.argusSimNow())

    def init(self, device: int = 0) -> None:
        self.check("cuInit", self.lib.cuInit(0))
        dev = c_int()
        self.check("cuDeviceGet", self.lib.cuDeviceGet(byref(dev), device))
        ctx = c_void_p()
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(byref(ctx), dev))
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctx))

    def load_module(self, kernels: dict[str, float]) -> dict[str, int]:
        """Load a module whose kernels cost `ns_per_block`; return name -> CUfunction handle."""
        image = "//argus-sim-module\n" + "".join(f"{k} {v}\n" for k, v in kernels.items())
        mod = c_void_p()
        self.check("cuModuleLoadData", self.lib.cuModuleLoadData(byref(mod), image.encode()))
        out: dict[str, int] = {}
        for name in kernels:
            f = c_void_p()
            self.check("cuModuleGetFunction", self.lib.cuModuleGetFunction(byref(f), mod, name.encode()))
            out[name] = int(f.value or 0)
        return out

    def get_function_rc(self, name: str) -> int:
        """cuModuleGetFunction on a name that does not exist: returns the (non-zero) CUresult."""
        mod = c_void_p()
        self.check("cuModuleLoadData", self.lib.cuModuleLoadData(byref(mod), b"//argus-sim-module\n"))
        f = c_void_p()
        return int(self.lib.cuModuleGetFunction(byref(f), mod, name.encode()))

    def launch(self, fn: int, blocks: int, stream: int) -> None:
        rc = self.lib.cuLaunchKernel(fn, max(1, blocks), 1, 1, 128, 1, 1, 0, stream, None, None)
        if rc:
            self.check("cuLaunchKernel", rc)

    def stream(self) -> int:
        s = c_void_p()
        self.check("cuStreamCreate", self.lib.cuStreamCreate(byref(s), 1))
        return int(s.value or 0)

    def event(self, flags: int = 0) -> int:
        e = c_void_p()
        self.check("cuEventCreate", self.lib.cuEventCreate(byref(e), flags))
        return int(e.value or 0)

    def record(self, ev: int, stream: int) -> None:
        self.check("cuEventRecord", self.lib.cuEventRecord(ev, stream))

    def wait_event(self, stream: int, ev: int) -> None:
        self.check("cuStreamWaitEvent", self.lib.cuStreamWaitEvent(stream, ev, 0))

    def query(self, ev: int) -> int:
        return int(self.lib.cuEventQuery(ev))

    def event_sync(self, ev: int) -> None:
        self.check("cuEventSynchronize", self.lib.cuEventSynchronize(ev))

    def elapsed_ms(self, start: int, end: int) -> float:
        ms = c_float()
        self.check("cuEventElapsedTime", self.lib.cuEventElapsedTime(byref(ms), start, end))
        return float(ms.value)

    def sync(self, stream: int) -> None:
        self.check("cuStreamSynchronize", self.lib.cuStreamSynchronize(stream))

    def sync_epoch(self) -> int:
        """Host-blocking syncs returned so far in this process (the tracer's epochs; sim-only)."""
        return int(self.lib.argusSimSyncEpoch())

    def not_ready_count(self, from_epoch: int, to_epoch: int) -> int:
        """cuEventQuery results CUDA_ERROR_NOT_READY, any thread, in epochs [from, to) (sim-only)."""
        return int(self.lib.argusSimNotReadyCount(from_epoch, to_epoch))

    def last_sync(self) -> Tuple[int, int]:
        """When this thread's last host-blocking sync entered and returned, inside the library
        (CLOCK_MONOTONIC ns; sim-only)."""
        enter, exit_ = c_int64(), c_int64()
        self.lib.argusSimLastSync(byref(enter), byref(exit_))
        return enter.value, exit_.value

    def ctx_sync(self) -> None:
        self.check("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    def alloc(self, nbytes: int) -> int:
        p = c_uint64()
        self.check("cuMemAlloc_v2", self.lib.cuMemAlloc_v2(byref(p), c_size_t(nbytes)))
        return int(p.value)

    def free(self, ptr: int) -> None:
        self.check("cuMemFree_v2", self.lib.cuMemFree_v2(ptr))

    def h2d_async(self, dst: int, nbytes: int, stream: int) -> None:
        self.check("cuMemcpyHtoDAsync_v2", self.lib.cuMemcpyHtoDAsync_v2(dst, self._host_buf, nbytes, stream))

    def d2h_async(self, src: int, nbytes: int, stream: int) -> None:
        self.check("cuMemcpyDtoHAsync_v2", self.lib.cuMemcpyDtoHAsync_v2(self._host_buf, src, nbytes, stream))


class Nccl:
    """NCCL calls with their C signatures (communicator and stream handles are ints)."""

    def __init__(self, libs: SimLibs | None = None) -> None:
        libs = libs or build()
        self.lib = ctypes.CDLL(str(libs.libnccl))
        L = self.lib
        L.ncclGetErrorString.restype = c_char_p
        L.ncclCommInitRank.argtypes = [POINTER(c_void_p), c_int, UniqueId, c_int]
        L.ncclCommInitRankConfig.argtypes = [POINTER(c_void_p), c_int, UniqueId, c_int, c_void_p]
        L.ncclCommSplit.argtypes = [c_void_p, c_int, c_int, POINTER(c_void_p), c_void_p]
        coll: List[Any] = [c_void_p, c_void_p, c_size_t, c_int]
        L.ncclAllReduce.argtypes = [*coll, c_int, c_void_p, c_void_p]
        L.ncclAllGather.argtypes = [*coll, c_void_p, c_void_p]
        L.ncclReduceScatter.argtypes = [*coll, c_int, c_void_p, c_void_p]
        L.ncclBroadcast.argtypes = [*coll, c_int, c_void_p, c_void_p]
        L.ncclReduce.argtypes = [*coll, c_int, c_int, c_void_p, c_void_p]
        L.ncclSend.argtypes = [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
        L.ncclRecv.argtypes = [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
        L.ncclCommDestroy.argtypes = [c_void_p]
        L.ncclCommCount.argtypes = [c_void_p, POINTER(c_int)]
        L.ncclCommUserRank.argtypes = [c_void_p, POINTER(c_int)]
        L.argusSimSetLink.argtypes = [c_int, c_int, c_double]
        L.argusSimSetLink.restype = None
        L.argusSimCollTimes.argtypes = [c_void_p, c_uint64, POINTER(c_int64), POINTER(c_int64)]
        L.argusSimCollTimes.restype = c_int
        L.argusSimCommSpansHosts.argtypes = [c_void_p]
        L.argusSimCommSpansHosts.restype = c_int
        # NCCL never dereferences these in the simulation; real code passes device pointers.
        self._buf = ctypes.c_void_p(0x7E0000000000)

    def check(self, call: str, rc: int) -> int:
        if rc != 0:
            raise GpuError("NCCL", call, rc, (self.lib.ncclGetErrorString(rc) or b"?").decode())
        return rc

    def version(self) -> int:
        v = c_int()
        self.check("ncclGetVersion", self.lib.ncclGetVersion(byref(v)))
        return v.value

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check("ncclGetUniqueId", self.lib.ncclGetUniqueId(byref(uid)))
        return bytes(ctypes.string_at(byref(uid), 128))

    def init_rank(self, nranks: int, uid: bytes, rank: int, config: bool = False) -> int:
        u = UniqueId()
        ctypes.memmove(byref(u), uid, 128)
        comm = c_void_p()
        if config:
            self.check(
                "ncclCommInitRankConfig", self.lib.ncclCommInitRankConfig(byref(comm), nranks, u, rank, None)
            )
        else:
            self.check("ncclCommInitRank", self.lib.ncclCommInitRank(byref(comm), nranks, u, rank))
        return int(comm.value or 0)

    def split(self, comm: int, color: int, key: int) -> int:
        new = c_void_p()
        self.check("ncclCommSplit", self.lib.ncclCommSplit(comm, color, key, byref(new), None))
        return int(new.value or 0)

    def count(self, comm: int) -> int:
        n = c_int()
        self.check("ncclCommCount", self.lib.ncclCommCount(comm, byref(n)))
        return n.value

    def user_rank(self, comm: int) -> int:
        n = c_int()
        self.check("ncclCommUserRank", self.lib.ncclCommUserRank(comm, byref(n)))
        return n.value

    def all_reduce(self, count: int, dtype: str, comm: int, stream: int) -> None:
        self.check(
            "ncclAllReduce",
            self.lib.ncclAllReduce(self._buf, self._buf, count, NCCL_DTYPES[dtype], NCCL_SUM, comm, stream),
        )

    def all_gather(self, sendcount: int, dtype: str, comm: int, stream: int) -> None:
        self.check(
            "ncclAllGather",
            self.lib.ncclAllGather(self._buf, self._buf, sendcount, NCCL_DTYPES[dtype], comm, stream),
        )

    def reduce_scatter(self, recvcount: int, dtype: str, comm: int, stream: int) -> None:
        self.check(
            "ncclReduceScatter",
            self.lib.ncclReduceScatter(
                self._buf, self._buf, recvcount, NCCL_DTYPES[dtype], NCCL_SUM, comm, stream
            ),
        )

    def broadcast(self, count: int, dtype: str, root: int, comm: int, stream: int) -> None:
        self.check(
            "ncclBroadcast",
            self.lib.ncclBroadcast(self._buf, self._buf, count, NCCL_DTYPES[dtype], root, comm, stream),
        )

    def send(self, count: int, dtype: str, peer: int, comm: int, stream: int) -> None:
        self.check("ncclSend", self.lib.ncclSend(self._buf, count, NCCL_DTYPES[dtype], peer, comm, stream))

    def recv(self, count: int, dtype: str, peer: int, comm: int, stream: int) -> None:
        self.check("ncclRecv", self.lib.ncclRecv(self._buf, count, NCCL_DTYPES[dtype], peer, comm, stream))

    def group_start(self) -> None:
        self.check("ncclGroupStart", self.lib.ncclGroupStart())

    def group_end(self) -> None:
        self.check("ncclGroupEnd", self.lib.ncclGroupEnd())

    def destroy(self, comm: int) -> None:
        self.check("ncclCommDestroy", self.lib.ncclCommDestroy(comm))

    def coll_times(self, comm: int, seq: int) -> Optional[Tuple[int, int]]:
        """(when this rank's stream reached collective `seq` of `comm`, when its network proxy
        first sent for it; 0 when none yet or the communicator stays on one host), CLOCK_REALTIME
        ns; None when the stream has not reached it (sim-only ground truth)."""
        arrive, first = c_int64(), c_int64()
        if self.lib.argusSimCollTimes(comm, seq, byref(arrive), byref(first)) != 0:
            return None
        return arrive.value, first.value

    def spans_hosts(self, comm: int) -> bool:
        return self.lib.argusSimCommSpansHosts(comm) == 1

    def set_link(self, a: int, b: int, factor: float) -> None:
        self.lib.argusSimSetLink(a, b, factor)
