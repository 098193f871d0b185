"""libcuda.so.1 (the CUDA driver API): what the CUDA channel probes.

Frameworks reach the driver through libcudart, so probing libcuda sees every launch, copy,
sync and event regardless of the runtime version. Source: argus/bpf/cuda.bpf.c.
"""

from __future__ import annotations

from typing import Optional, Tuple

from argus.probes.base import (
    ENQUEUE,
    EVENT_RECORD,
    GRAPH_LAUNCH,
    LAUNCH,
    SYNC,
    Channel,
    MappedLibrary,
    UprobeSpec,
    find_library,
    register_channel,
)

S = UprobeSpec
SPECS: Tuple[UprobeSpec, ...] = (
    S("cuLaunchKernel", required=True, cls=LAUNCH),
    S("cuLaunchKernelEx", cls=LAUNCH),
    # host-blocking: each closes an epoch (synchronous copies and memsets wait for the stream too)
    S("cuStreamSynchronize", required=True, cls=SYNC),
    S("cuEventSynchronize", cls=SYNC),
    S("cuCtxSynchronize", cls=SYNC),
    S("cuMemcpyHtoD_v2", cls=SYNC),
    S("cuMemcpyDtoH_v2", cls=SYNC),
    S("cuMemcpyDtoD_v2", cls=SYNC),
    S("cuMemsetD8_v2", cls=SYNC),
    S("cuMemsetD32_v2", cls=SYNC),
    S("cuMemcpyHtoDAsync_v2", cls=ENQUEUE),
    S("cuMemcpyDtoHAsync_v2", cls=ENQUEUE),
    S("cuMemcpyDtoDAsync_v2", cls=ENQUEUE),
    S("cuMemsetD8Async", cls=ENQUEUE),
    S("cuMemAlloc_v2"),
    S("cuMemFree_v2"),
    S("cuEventRecord", cls=EVENT_RECORD),
    S("cuEventElapsedTime"),
    S("cuModuleGetFunction"),
    S("cuInit", entry=False),
    S("cuCtxSetCurrent", entry=False),
    S("cuModuleLoadData", entry=False),
    S("cuStreamCreate", entry=False),
    S("cuStreamQuery", entry=False),
    S("cuStreamWaitEvent"),
    S("cuEventCreate", entry=False),
    S("cuEventQuery"),
    S("cuGraphLaunch", report_missing=False, cls=GRAPH_LAUNCH),
)
# Per-thread default stream builds of the runtime (nvcc --default-stream per-thread) call these
# variants; each counts as its call (the same BPF programs and call id). Many builds lack them.
_VARIANTS = {
    "ptsz": (
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuGraphLaunch",
        "cuStreamSynchronize",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemsetD8Async",
        "cuEventRecord",
        "cuStreamQuery",
        "cuStreamWaitEvent",
    ),
    "ptds": ("cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2", "cuMemsetD8_v2", "cuMemsetD32_v2"),
}
_BASE = {s.symbol: s for s in SPECS}
SPECS += tuple(
    S(f"{call}_{suffix}", entry=_BASE[call].entry, handler=call, report_missing=False, cls=_BASE[call].cls)
    for suffix, calls in _VARIANTS.items()
    for call in calls
)
# calls probed at entry only (none: every other CUDA call's result is checked)
ENTRY_ONLY: frozenset = frozenset()
# Launches are the hottest calls (hundreds per step): their return costs a uretprobe, ~1.2 us a
# launch on the CI VM (docs/benchmarks.md), so it is probed only for --launch-latency and `argus
# record`. A failed launch still shows: frameworks check every launch and raise, and sticky
# errors come back from the next sync, whose result is counted.
LAUNCH_CALLS = frozenset(s.symbol for s in SPECS if s.cls in (LAUNCH, GRAPH_LAUNCH) and not s.handler)
# Event recordings and stream waits come at stream-operation rates (PyTorch: an event before and
# after every collective, the caching allocator's per block, a wait per collective): their return
# probes only counted the result, a uretprobe each (~1 us a call on kernel 6.18, twice an entry
# probe: docs/benchmarks.md 8.11). Probed with `argus record` only; a failed recording or wait
# still shows as launches' do: frameworks check every call and raise, and a sticky error comes back
# from the next sync or query, whose results are counted.
RESULT_ONLY_CALLS = frozenset(
    s.symbol for s in SPECS if (s.handler or s.symbol) in ("cuEventRecord", "cuStreamWaitEvent")
)


def entry_only(launch_returns: bool, result_returns: bool = False) -> frozenset:
    """The libcuda calls whose return is not probed: launches unless `launch_returns`, event
    recordings and stream waits unless `result_returns` (`argus record`)."""
    out = ENTRY_ONLY if launch_returns else ENTRY_ONLY | LAUNCH_CALLS
    return out if result_returns else out | RESULT_ONLY_CALLS


CHANNEL = Channel(
    name="cuda", library_re=r"libcuda\.so(\.\d+)*", source="cuda.bpf.c", specs=SPECS, macro="ARGUS_CUDA"
)
register_channel(CHANNEL)

SYNC_CALLS = tuple(s.symbol for s in SPECS if s.cls == SYNC and not s.handler)
MEM_KINDS = ("HtoD", "DtoH", "DtoD", "memset", "alloc", "free", "free_unknown", "launch_wait")


def detect(pid: int) -> Optional[MappedLibrary]:
    """libcuda.so.1 as mapped by `pid`, or None when the process does not use the driver API."""
    return find_library(pid, CHANNEL.library_re)
