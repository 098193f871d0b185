"""The agent's monotonic → realtime offset, and how far to trust it.

BPF stamps events with CLOCK_MONOTONIC; summaries carry CLOCK_REALTIME so that ranks on different
hosts can be compared. `wall_offset()` reads the realtime clock bracketed by two monotonic reads
(best of a few tries) and reports the offset with its uncertainty: half the bracket, plus the
kernel's own estimate of the realtime clock's error (``adjtimex`` esterror) when NTP/PTP keeps it
synchronised. An unsynchronised clock adds nothing here (its error is unknown, not small):
`sync_state()` says so, and the heartbeat carries it (``clock_synced``, ``clock_maxerror_us``).
"""

from __future__ import annotations

import ctypes
import struct
import time
from typing import Optional, Tuple

_STA_UNSYNC = 0x0040
_TIME_ERROR = 5
_libc: Optional[ctypes.CDLL] = None


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
    for _ in range(tries):
        m0 = time.monotonic_ns()
        r = time.time_ns()
        m1 = time.monotonic_ns()
        gap = m1 - m0
        if best_gap is None or gap < best_gap:
            best_off, best_gap = r - (m0 + m1) // 2, gap
    synced, est_us, _ = sync_state()
    return best_off, (best_gap or 0) // 2 + 1 + (est_us * 1000 if synced else 0)
