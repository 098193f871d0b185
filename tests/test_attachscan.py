"""When a thread found blocked at attach stops counting as blocked (argus.agent.attachscan).

A waiter that polls (a futex with a timeout, then a liveness check of its peers) changes its stack
and instruction pointers every few hundred ms, so it is looked at again. On a loaded host the
rescan may read it on a CPU: that says nothing, and dropping it named a rank blocked in the
collective as the one that never arrived (a CI run: `hang [2, 6]` where only 6 was missing).
The thread-reading functions are replaced here; tests/test_threadscan.py reads real threads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import pytest

from argus.agent import attachscan, threadscan
from argus.agent.attachscan import AttachScans, AttachState, Blocked
from argus.agent.threadscan import NativeFrame, ProcessScan, ThreadScan

PID, TID = 4242, 4243
LIB = SimpleNamespace(
    library=SimpleNamespace(path="/opt/nccl/lib/libnccl.so.2", inode=1),
    probes=[SimpleNamespace(spec=SimpleNamespace(symbol="ncclAllReduce", prog="ncclAllReduce"))],
)
Pointers = Tuple[int, int]  # (stack pointer, instruction pointer) of a thread in a syscall
IN_CALL = (NativeFrame("libnccl.so.2", None, 0x1234), NativeFrame("libnccl.so.2", "ncclAllReduce", 0x40))


class World:
    """What /proc says of the thread, one reading after another."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, readings: List[Tuple[Optional[Pointers], Any]]):
        self.readings = list(readings)
        self.alive = True
        self.scans = 0
        self.sp_pc: Optional[Tuple[int, int]] = None
        monkeypatch.setattr(threadscan, "sp_pc", self._sp_pc)
        monkeypatch.setattr(threadscan, "thread_alive", lambda pid, tid: self.alive)
        monkeypatch.setattr(threadscan, "scan", self._scan)
        monkeypatch.setattr(attachscan.AttachScans, "_libraries", lambda self_, pid, libs: [])

    def _sp_pc(self, pid: int, tid: int) -> Optional[Tuple[int, int]]:
        self.sp_pc, self.thread = self.readings.pop(0)
        return self.sp_pc

    def _scan(self, pid: int, libs: Any, python: Any = None) -> ProcessScan:
        self.scans += 1
        return ProcessScan(pid, (self.thread,) if self.thread is not None else ())


def thread(syscall: Optional[str], native: Tuple[NativeFrame, ...]) -> ThreadScan:
    return ThreadScan(TID, "python", "R" if syscall == "running" else "S", syscall, native, (), 0, "python3")


def blocked_scans() -> AttachScans:
    s = AttachScans()
    s.state[PID] = AttachState(PID, blocked=[Blocked(TID, "ncclAllReduce", 100, sp=0x7000, pc=0x10)])
    return s


def still(s: AttachScans, times: int, records: Optional[Dict[int, int]] = None, steps: int = 0) -> List[bool]:
    return [bool(s.still_blocked(PID, records or {}, steps, [LIB])) for _ in range(times)]  # type: ignore[list-item]


def test_a_thread_read_on_a_cpu_at_the_rescan_stays_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    # moved (a liveness check), then read running by the rescan, then back in its futex
    w = World(
        monkeypatch,
        [
            ((0x6F00, 0x20), thread("running", ())),
            ((0x6F00, 0x20), thread("running", ())),
            ((0x7000, 0x10), None),
        ],
    )
    s = blocked_scans()
    assert still(s, 3) == [True, True, True]
    assert w.scans == 2


def test_a_thread_seen_inside_the_call_follows_its_new_pointers(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(monkeypatch, [((0x6F00, 0x20), thread("read", IN_CALL)), ((0x6F00, 0x20), None)])
    s = blocked_scans()
    assert still(s, 2) == [True, True]
    assert w.scans == 1  # the second reading matched the pointers the rescan took


def test_a_thread_that_left_the_call_is_dropped_after_two_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    outside = thread("futex", ())  # in a syscall, no frame of the library left on its stack
    w = World(monkeypatch, [((0x5000, 0x30), outside), ((0x5000, 0x30), outside), ((0x5000, 0x30), outside)])
    s = blocked_scans()
    assert still(s, 3) == [True, False, False]
    assert w.scans == 2


def test_one_torn_reading_between_good_ones_is_forgiven(monkeypatch: pytest.MonkeyPatch) -> None:
    other = (NativeFrame("libnccl.so.2", "ncclCommCount", 0x10),)  # a stale frame read mid-move
    World(
        monkeypatch,
        [
            ((0x5000, 0x30), thread("read", other)),
            ((0x6F00, 0x20), thread("futex", IN_CALL)),
            ((0x5000, 0x30), thread("read", other)),
            ((0x6F00, 0x20), thread("futex", IN_CALL)),
        ],
    )
    assert still(blocked_scans(), 4) == [True, True, True, True]


def test_a_record_a_step_or_an_exit_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    World(monkeypatch, [((0x7000, 0x10), None)] * 4)
    assert still(blocked_scans(), 1, records={TID: 200}) == [False]  # a probed call since the scan
    assert still(blocked_scans(), 1, steps=1) == [False]  # the process ended a step
    w = World(monkeypatch, [(None, None)])
    w.alive = False
    assert still(blocked_scans(), 1) == [False]
