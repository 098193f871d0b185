"""Hangs already in progress when the agent attaches: threads found blocked inside a probed library.

Uprobes see calls entered after attach, so a rank that has sat in ncclAllReduce or
cuStreamSynchronize for an hour shows nothing. At attach every target's threads are scanned
(argus/agent/threadscan.py: state, syscall, return addresses into libnccl/libcuda/libcudart on the
stack, the Python stack); a thread inside a probed call becomes an in-flight call "since attach"
(a lower bound of how long it has been blocked). It stays one while it sits where it was: no ring
record came from that thread since (its next call would make one), its process ended no step, and
its syscall's stack and instruction pointers did not move. What the other ranks are doing (their
Python location) is kept for the heartbeat, and refreshed now and then while anything is blocked.
A healthy rank caught in a sync at attach makes a record within its next step and drops out.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from argus.agent import threadscan
from argus.agent.threadscan import LibraryText, NativeFrame, ProcessScan
from argus.probes.base import LibraryProbes
from argus.probes.cpython import Interpreter, Mem

WHERE_REFRESH_S = 10.0


@dataclass
class Blocked:
    tid: int
    call: str  # the probed entry point it is inside (or the library frame it sits in)
    since_ns: int  # monotonic: when the scan found it
    sp: int
    pc: int
    comm: int = 0  # the communicator handle found on its stack (an NCCL call), 0 when none
    away: int = 0  # rescans in a row that read it in a syscall outside the call
    channel: str = ""  # the channel of the library it is in ("nccl": `comm` was looked for)


COMM_SCAN_BYTES = 16 * 1024  # of the blocked thread's stack, from its stack pointer up


def comm_on_stack(pid: int, sp: int, is_comm: Callable[[int], bool], nbytes: int = COMM_SCAN_BYTES) -> int:
    """The communicator a thread blocked in an NCCL call is working on: the argument register was
    saved somewhere on its stack, so the first stack word that `is_comm` accepts (its rank and
    nRanks, read through the build's layout, make sense) is taken. 0 when none does."""
    heap = _heap_ranges(pid)
    mem = Mem(pid)
    try:
        raw = None
        for n in (nbytes, 4096, 1024):  # the stack may end sooner
            raw = mem.read(sp & ~7, n)
            if raw:
                break
        if not raw:
            return 0
        seen = set()
        for (v,) in struct.iter_unpack("<Q", raw[: len(raw) // 8 * 8]):
            if v < 0x10000 or v >= 1 << 47 or v & 7 or v in seen:
                continue
            seen.add(v)
            if not any(lo <= v < hi for lo, hi in heap):  # a communicator is malloc'd: not stack/code
                continue
            if is_comm(v):
                return v
        return 0
    finally:
        mem.close()


@dataclass
class AttachState:
    pid: int
    blocked: List[Blocked] = field(default_factory=list)
    where: str = ""
    where_ns: int = 0
    steps_at_scan: int = 0


def _entry_point(t: threadscan.ThreadScan, probed: Dict[str, set]) -> Optional[Tuple[str, str]]:
    """(call, library basename): the outermost frame of the thread that is a probed call of its
    library (what the program called: ncclAllReduce, cuStreamSynchronize), else its innermost
    named library frame."""
    for f in reversed(t.native):
        if f.symbol is not None and f.symbol in probed.get(f.library, ()):
            return f.symbol, f.library
    fr: Optional[NativeFrame] = t.frame
    return (fr.label(), fr.library) if fr is not None else None


def _probed(lp: LibraryProbes) -> set:
    """Names a frame of a probed call may carry: the exported symbol, or the call it counts as."""
    return {p.spec.symbol for p in lp.probes} | {p.spec.prog for p in lp.probes}


def _heap_ranges(pid: int) -> List[Tuple[int, int]]:
    """Writable anonymous mappings and the heap: where malloc puts a communicator."""
    out: List[Tuple[int, int]] = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if len(parts) >= 5 and parts[1].startswith("rw") and path in ("", "[heap]"):
                    lo, _, hi = parts[0].partition("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return out


class AttachScans:
    def __init__(self) -> None:
        self._texts: Dict[Tuple[int, int], LibraryText] = {}  # per library file, rebased per process
        self.state: Dict[int, AttachState] = {}
        # pids with threads found blocked and not yet seen leaving: the session keeps their threads'
        # latest record times (for still_blocked) and no one else's
        self.blocked_pids: Set[int] = set()

    def _libraries(self, pid: int, libs: Sequence[LibraryProbes]) -> List[LibraryText]:
        out = []
        for lp in libs:
            base = self._texts.get(lp.library.inode)
            if base is None:
                # implementations behind dispatch stubs have no symbol (libcuda is stripped): name them
                behind = [(p.target, p.spec.prog) for p in lp.probes if p.stub is not None and not p.path]
                base = self._texts[lp.library.inode] = LibraryText.of(pid, lp.library, behind, elf=lp.elf)
                out.append(base)
                continue
            here = LibraryText.of(pid, lp.library, elf=None, symbols_from=base)
            out.append(here)
        return out

    def scan(
        self,
        pid: int,
        libs: Sequence[LibraryProbes],
        python: Optional[Interpreter],
        steps: int = 0,
        is_comm: Optional[Callable[[int], bool]] = None,
    ) -> AttachState:
        texts = self._libraries(pid, libs)
        ps = threadscan.scan(pid, texts, python)
        probed = {t.name: _probed(lp) for t, lp in zip(texts, libs)}
        channels = {t.name: lp.channel.name for t, lp in zip(texts, libs)}
        now = time.monotonic_ns()
        st = AttachState(pid, where=ps.where(), where_ns=now, steps_at_scan=steps)
        for t in ps.threads:
            if not t.in_library:
                continue
            hit = _entry_point(t, probed)
            sp_pc = threadscan.sp_pc(pid, t.tid)
            if hit is not None and sp_pc is not None:
                call, channel = hit[0], channels.get(hit[1], "")
                comm = comm_on_stack(pid, sp_pc[0], is_comm) if is_comm and channel == "nccl" else 0
                st.blocked.append(Blocked(t.tid, call, now, *sp_pc, comm=comm, channel=channel))
        self.state[pid] = st
        if st.blocked:
            self.blocked_pids.add(pid)
        else:
            self.blocked_pids.discard(pid)
        return st

    def still_blocked(
        self, pid: int, last_record: Dict[int, int], steps: int, libs: Sequence[LibraryProbes] = ()
    ) -> List[Blocked]:
        """The scan's blocked threads of `pid` that have not left their call (`last_record`: tid ->
        ts of the thread's latest ring record; `steps`: summaries the process emitted so far). A
        thread whose syscall moved (a blocking wait may poll: futex, then a liveness check of its
        peers) is looked at again. It is dropped only on evidence that it left: a probed call since,
        a step ended, the thread gone, or two rescans in a row that read it in a syscall with the
        call's frame gone from its stack. A thread read on a CPU (no stack pointer to read) or
        in a torn read once says nothing: on a loaded host a woken waiter may sit runnable for
        longer than a scan waits, and dropping it would name a blocked rank as the one missing."""
        st = self.state.get(pid)
        if st is None or not st.blocked:
            self.blocked_pids.discard(pid)
            return []
        if steps > st.steps_at_scan:
            st.blocked = []  # the process ended a step: it is not hung
            self.blocked_pids.discard(pid)
            return []
        keep: List[Blocked] = []
        rescan: Optional[ProcessScan] = None
        for b in st.blocked:
            if last_record.get(b.tid, 0) > b.since_ns:
                continue  # it made a probed call since: it left the one it was in
            now = threadscan.sp_pc(pid, b.tid)
            if now is None and not threadscan.thread_alive(pid, b.tid):
                continue
            if now is not None and now != (b.sp, b.pc):
                if rescan is None:
                    rescan = threadscan.scan(pid, self._libraries(pid, libs))
                t = rescan.thread(b.tid)
                if t is None:
                    if not threadscan.thread_alive(pid, b.tid):
                        continue
                elif t.syscall in (None, "running"):
                    pass  # on a CPU, or unreadable: nothing learned
                else:
                    probed = {lp.library.path.rsplit("/", 1)[-1]: _probed(lp) for lp in libs}
                    hit = _entry_point(t, probed)
                    if t.in_library and hit is not None and hit[0] == b.call:
                        b.sp, b.pc, b.away = now[0], now[1], 0
                    else:
                        b.away += 1
                        if b.away >= 2:
                            continue
            keep.append(b)
        st.blocked = keep
        if not keep:
            self.blocked_pids.discard(pid)
        return keep

    def where(self, pid: int, libs: Sequence[LibraryProbes], python: Optional[Interpreter]) -> str:
        """What the process is doing, rescanned when older than WHERE_REFRESH_S."""
        st = self.state.get(pid)
        now = time.monotonic_ns()
        if st is None:
            return ""
        if now - st.where_ns >= WHERE_REFRESH_S * 1e9:
            ps: ProcessScan = threadscan.scan(pid, self._libraries(pid, libs), python)
            st.where, st.where_ns = ps.where(), now
        return st.where

    def forget(self, pid: int) -> None:
        self.state.pop(pid, None)
        self.blocked_pids.discard(pid)
