"""libcudart.so (the CUDA runtime API): what the CUDA runtime channel probes.

Every probed call is counted per epoch at return, and every non-zero cudaError_t is counted per
(call, result). Nothing else: no bytes, no kernel names, no records. A process normally also maps
libcuda.so.1, and the runtime reaches the driver through it, so launches, copies, syncs and their
timings are already counted by the CUDA (driver) channel; the step summary's "cudart" section
reports only runtime call counts and errors, which is what tells a runtime failure apart (e.g.
cudaErrorInsufficientDriver, 35, on a host without a driver, when libcuda is not even loaded).

pip wheels (nvidia-cuda-runtime-cu12, nvidia-cuda-runtime) map it from
site-packages/nvidia/cuda_runtime/lib; it is found per process in /proc/PID/maps. Every probe is a
return probe (one hit per call). Source: argus/bpf/cudart.bpf.c.
"""

from __future__ import annotations

from typing import Optional

from argus.probes.base import ENQUEUE, Channel, MappedLibrary, UprobeSpec, find_library, register_channel

S = UprobeSpec
# Launches and syncs are plain calls here: this channel only counts calls and results (the driver
# channel counts the launches and closes epochs at the syncs). Its stream-ordered calls are
# enqueues, drawn on a stream in `argus record`'s trace.
SPECS = (
    S("cudaRuntimeGetVersion", entry=False),
    S("cudaDriverGetVersion", entry=False),
    S("cudaGetDeviceCount", entry=False),
    S("cudaSetDevice", entry=False),
    S("cudaMalloc", entry=False),
    S("cudaFree", entry=False),
    S("cudaMallocAsync", entry=False, cls=ENQUEUE),
    S("cudaFreeAsync", entry=False, cls=ENQUEUE),
    S("cudaMemcpy", entry=False),
    S("cudaMemcpyAsync", entry=False, cls=ENQUEUE),
    S("cudaMemsetAsync", entry=False, cls=ENQUEUE),
    S("cudaLaunchKernel", entry=False),
    S("cudaLaunchKernelExC", entry=False),
    S("cudaStreamCreate", entry=False),
    S("cudaStreamCreateWithFlags", entry=False),
    S("cudaStreamSynchronize", entry=False),
    S("cudaStreamWaitEvent", entry=False),
    S("cudaDeviceSynchronize", entry=False),
    S("cudaEventCreate", entry=False),
    S("cudaEventRecord", entry=False),
    S("cudaEventSynchronize", entry=False),
    S("cudaEventElapsedTime", entry=False),
    S("cudaGetLastError", entry=False),
)
CHANNEL = Channel(
    name="cudart",
    library_re=r"libcudart\.so(\.\d+)*",
    source="cudart.bpf.c",
    specs=SPECS,
    macro="ARGUS_CUDART",
)
register_channel(CHANNEL)
# every runtime call is probed at return only
ENTRY_ONLY: frozenset = frozenset()


def detect(pid: int) -> Optional[MappedLibrary]:
    """libcudart.so.N as mapped by `pid`, or None (statically linked runtimes are not seen)."""
    return find_library(pid, CHANNEL.library_re)
