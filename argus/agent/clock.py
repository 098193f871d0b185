"""The agent's monotonic → realtime offset, and how far to trust it.

BPF stamps events with CLOCK_MONOTONIC; summaries carry CLOCK_REALTIME so that ranks on different
hosts can be compared. `wall_offset()` reads the realtime clock bracketed by two monotonic reads
(best of a few tries) and reports the offset with its uncertainty: half the bracket, plus the
kernel's own estimate of the realtime clock's error (``adjtimex`` esterror) when NTP/PTP keeps it
synchronised. An unsynchronised clock adds nothing here (its error is unknown, not small):
`sync_state()` says so, and the heartbeat carries it (``clock_synced``, ``clock_maxerror_us``).

Fault injection (tests only): ``ARGUS_FAULT_CLOCK_SKEW_MS=50`` makes every realtime reading of this
agent that many ms off (negative: behind), as on a host whose clock is skewed. It is applied here,
where the agent reads the wall clock, so everything downstream sees what a skewed host would send.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from typing import Optional, Tuple

from argus.errors import UsageError

SKEW_ENV = "ARGUS_FAULT_CLOCK_SKEW_MS"
_STA_UNSYNC = 0x0040
_TIME_ERROR = 5
_libc: Optional[ctypes.CDLL] = None
_skew_ns: Optional[int] = None


def injected_skew_ns() -> int:
    """The fault-injected offset of this agent's wall clock (0 unless ``ARGUS_FAULT_CLOCK_SKEW_MS``)."""
    global _skew_ns
    if _skew_ns is None:
        raw = os.environ.get(SKEW_ENV, "").strip()
        try:
            ms = float(raw) if raw else 0.0
            if not abs(ms) < 1e9:  # also NaN
                raise ValueError
        except ValueError:
            raise UsageError(
                f"{SKEW_ENV}={raw!r} is not a number of milliseconds",
                f"a fault-injection knob for tests, e.g. {SKEW_ENV}=-50; unset it otherwise",
            ) from None
        _skew_ns = int(ms * 1e6)
    return _skew_ns


def realtime_ns() -> int:
    """CLOCK_REALTIME as this agent reports it (with the injected skew, if any)."""
    return time.time_ns() + injected_skew_ns()


def sync_state() -> Tuple[bool, int, int]:
    """(synchronised, esterror µs, maxerror µs) from adjtimex(2) (read-only: modes = 0).

    Returns (False, 0, 0) where the call is unavailable."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct timex is 208 bytes on 64-bit Linux
        rc = _libc.adjtimex(buf)
    except (OSError, AttributeError):
        return False, 0, 0
    if rc < 0:
        return False, 0, 0
    _offset, _freq, maxerror, esterror = struct.unpack_from("4q", buf.raw, 8)
    (status,) = struct.unpack_from("i", buf.raw, 40)
    synced = rc != _TIME_ERROR and not status & _STA_UNSYNC
    return synced, int(esterror), int(maxerror)


def wall_offset(tries: int = 5) -> Tuple[int, int]:
    """(realtime − monotonic in ns, its uncertainty in ns)."""
    best_off, best_gap = 0, None
    skew = injected_skew_ns()
    for _ in range(tries):
        m0 = time.monotonic_ns()
        r = time.time_ns() + skew
        m1 = time.monotonic_ns()
        gap = m1 - m0
        if best_gap is None or gap < best_gap:
            best_off, best_gap = r - (m0 + m1) // 2, gap
    synced, est_us, _ = sync_state()
    return best_off, (best_gap or 0) // 2 + 1 + (est_us * 1000 if synced else 0)
