"""Garbage-collector settings for Argus's long-running processes (the probe agent, the aggregator).

Both keep tens of thousands of small, short-lived containers per second (a record per collective at
tensor-parallel rates in the agent; per-rank state per step in the aggregator). CPython's default
cyclic-GC cadence (a collection every 700 net allocations, a full one every 100 of those) then
rescans a large live heap over and over: 30% of the aggregator's CPU at 10,000 ranks, and 40% of
the agent's at the `tp` preset (41% → 25% of a core for 8 ranks, docs/benchmarks.md 8.7).
Reference counting frees what they drop; the cyclic collector only needs to run now and then.
"""

from __future__ import annotations

import ctypes
import gc


def tune_gc() -> None:
    gc.set_threshold(100_000, 50, 100)


def freeze_startup() -> None:
    """After start-up (imports, BPF compiled, probes attached): what exists now lives for the whole
    run, so later full collections need not scan it."""
    gc.collect()
    gc.freeze()
    release_free_memory()


def release_free_memory() -> None:
    """Give the C heap's free pages back to the kernel. Compiling the BPF program in-process
    (bcc runs LLVM) leaves tens of MB freed but held by glibc's allocator, counted in the agent's
    RSS for its whole run (docs/benchmarks.md 8.5)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
