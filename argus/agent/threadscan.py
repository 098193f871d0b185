"""Where each thread of a running process is, read from /proc at attach: no BPF, no ptrace.

Uprobes see only calls entered after attach, so a rank that has been blocked in ncclAllReduce or
cuStreamSynchronize for an hour is invisible to them. This module looks at the threads directly:

* `/proc/PID/task/TID/stat`, `schedstat` and `syscall`: state, CPU time, and for a thread blocked
  in a system call its number, user stack pointer and pc ("running" while it is on a CPU or
  runnable: it is re-read a few times over ~100 ms, since CUDA's spin-waiting sync threads call
  sched_yield often; a thread spinning purely in user space stays "running" and unscanned).
* Native frames by stack *scanning*: [sp, sp + stack_bytes) is read from /proc/PID/mem, up to the
  end of the mapping holding sp, and every 8-byte aligned value that points into an executable
  file mapping and follows a call instruction is taken as a return address. No unwind tables or
  frame pointers are needed (NVIDIA's builds have neither), but stale return addresses, left in
  slots of live frames by earlier calls, can appear: what counts is the innermost plausible frame.
  Two rules keep stale frames out of the verdict. Frames beyond the first return address into the
  Python interpreter are dropped (the thread is back in Python there; a library address further
  out is from an earlier call). A thread whose outermost frame is in a probed library (NCCL's
  proxy thread, CUDA's event threads) was started by that library and always sits in it, so it
  never counts as blocked.
* Python frames (`python` given): the thread's frame chain walked with the interpreter's offsets,
  with the current line from each code object's line table (CPython 3.9-3.13; "def line N", the
  function's first line, when the table or instruction pointer cannot be read).

Code bytes before a candidate return address are read from the process's memory rather than the
library file: one descriptor covers every mapping, including files only the process's mount
namespace sees. x86-64 only (the call decoding and syscall numbers): elsewhere native frames are
empty and syscalls are shown by number. Every read is bounded, and a thread or process that
vanishes mid-scan yields what was read, never an exception.
"""

from __future__ import annotations

import bisect
import os
import platform
import struct
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from argus.agent.pystack import LINE_OFFSETS, line_pep657
from argus.agent.pystack import python_stacks as _python_stacks
from argus.probes.base import MappedLibrary
from argus.probes.cpython import Interpreter
from argus.probes.elf import Elf, ElfError

__all__ = ["LINE_OFFSETS", "LibraryText", "NativeFrame", "ProcessScan", "ThreadScan", "line_pep657", "scan"]

STACK_BYTES = 256 * 1024
RETRY_S = 0.1  # how long threads found running are re-read
MAX_NATIVE_FRAMES = 64
MAX_THREADS = 4096
MAX_SYMBOL_DISTANCE = 1 << 20  # farther than this past a size-less symbol is not that function
X86_64 = platform.machine() in ("x86_64", "AMD64")
_BUCKET = 20  # exec ranges are indexed by 1 MB windows: one set lookup rejects most stack values
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# runtime files that start threads for others (pthread, std::thread): not where a thread "started"
_LIBC_LIKE = (
    "libc.so",
    "libc-",
    "libpthread",
    "ld-linux",
    "ld64.so",
    "[vdso]",
    "libstdc++",
    "libc++",
    "libgcc_s",
)

SYSCALLS_X86_64: Dict[int, str] = {
    0: "read",
    1: "write",
    3: "close",
    7: "poll",
    9: "mmap",
    11: "munmap",
    16: "ioctl",
    17: "pread64",
    19: "readv",
    20: "writev",
    23: "select",
    24: "sched_yield",
    28: "madvise",
    34: "pause",
    35: "nanosleep",
    42: "connect",
    43: "accept",
    44: "sendto",
    45: "recvfrom",
    46: "sendmsg",
    47: "recvmsg",
    61: "wait4",
    65: "semop",
    73: "flock",
    74: "fsync",
    128: "rt_sigtimedwait",
    130: "rt_sigsuspend",
    202: "futex",
    208: "io_getevents",
    219: "restart_syscall",
    230: "clock_nanosleep",
    232: "epoll_wait",
    243: "mq_timedreceive",
    247: "waitid",
    257: "openat",
    270: "pselect6",
    271: "ppoll",
    281: "epoll_pwait",
    288: "accept4",
    299: "recvmmsg",
    307: "sendmmsg",
    426: "io_uring_enter",
    441: "epoll_pwait2",
    449: "futex_waitv",
}


def syscall_name(nr: int) -> str:
    name = SYSCALLS_X86_64.get(nr) if X86_64 else None
    return name or f"syscall {nr}"


# ---- results --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NativeFrame:
    library: str  # basename of the file
    symbol: Optional[str]
    offset: int  # from the symbol; from the library's load address (an ELF vaddr) when symbol is None

    def label(self) -> str:
        if self.symbol is None:
            return f"{self.library}+{self.offset:#x}"
        return f"{self.symbol} ({self.library})"


@dataclass(frozen=True)
class ThreadScan:
    tid: int
    name: str  # comm
    state: str  # 'R', 'S', 'D', ...
    syscall: Optional[str]  # 'futex', 'clock_nanosleep', 'running'; None: unreadable or not in one
    native: Tuple[NativeFrame, ...]  # innermost first; only frames inside the given libraries
    python: Tuple[str, ...]  # "qualname (file:line)", innermost first
    cpu_ns: int  # on-CPU time so far (schedstat; utime+stime when absent)
    # basename of the file of its outermost frame outside libc and the C++ runtime: where it started;
    # None when the stack was not read up to its top
    started_in: Optional[str] = None

    @property
    def library_owned(self) -> bool:
        """Started by one of the scanned libraries (its own worker): always inside it."""
        return self.started_in is not None and any(f.library == self.started_in for f in self.native)

    @property
    def in_library(self) -> bool:
        return bool(self.native) and not self.library_owned

    @property
    def frame(self) -> Optional[NativeFrame]:
        """The innermost named library frame, else the innermost: an exported entry point (or a name
        the caller supplied) says more than an anonymous internal function below it."""
        return next((f for f in self.native if f.symbol is not None), self.native[0] if self.native else None)


@dataclass(frozen=True)
class ProcessScan:
    pid: int
    threads: Tuple[ThreadScan, ...]

    def thread(self, tid: int) -> Optional[ThreadScan]:
        return next((t for t in self.threads if t.tid == tid), None)

    def blocked_in(self) -> Optional[Tuple[int, NativeFrame]]:
        """(tid, frame) of the thread inside a scanned library, preferring one with a Python stack
        (the training loop), then the main thread; None when no thread is."""
        inside = [t for t in self.threads if t.in_library]
        if not inside:
            return None
        best = min(inside, key=lambda t: (not t.python, t.tid != self.pid, t.tid))
        frame = best.frame
        assert frame is not None  # in_library implies frames
        return best.tid, frame

    def where(self) -> str:
        """One line for a person: "blocked in ncclAllReduce (libnccl.so.2) from step (train.py:88)"
        or "in maybe_hang (trainer.py:185), clock_nanosleep"."""
        hit = self.blocked_in()
        if hit is not None:
            t = self.thread(hit[0])
            text = f"blocked in {hit[1].label()}"
            return f"{text} from {_short(t.python[0])}" if t is not None and t.python else text
        t = self._main()
        if t is None:
            return "no threads (the process has exited)"
        what = t.syscall or ("running" if t.state == "R" else f"state {t.state}")
        return f"in {_short(t.python[0])}, {what}" if t.python else f"{what} (no Python stack)"

    def _main(self) -> Optional[ThreadScan]:
        if not self.threads:
            return None
        return min(self.threads, key=lambda t: (not t.python, t.tid != self.pid, t.tid))


def blocked_threads(samples: Sequence[ProcessScan]) -> Dict[int, NativeFrame]:
    """Threads inside a scanned library in every sample (blocked there, or spinning there and caught
    in sched_yield), with their frame in the last sample."""
    common: Optional[Set[int]] = None
    last: Dict[int, NativeFrame] = {}
    for s in samples:
        here = {t.tid: t.frame for t in s.threads if t.in_library}
        common = set(here) if common is None else common & set(here)
        last.update({tid: f for tid, f in here.items() if f is not None})
    return {tid: last[tid] for tid in sorted(common or ())}


def _short(python_frame: str) -> str:
    """'f (/a/b/train.py:88)' -> 'f (train.py:88)'."""
    name, sep, rest = python_frame.rpartition(" (")
    return f"{name} ({os.path.basename(rest)}" if sep else python_frame


# ---- libraries ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Map:
    start: int
    end: int
    perms: str
    offset: int
    path: str


def _read_maps(pid: int) -> List[_Map]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        path = parts[5].strip() if len(parts) == 6 else ""
        out.append(_Map(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), path))
    return out


@dataclass(frozen=True)
class LibraryText:
    """What symbolising one mapped library needs: process address - bias = ELF vaddr."""

    path: str  # as the process maps it
    bias: int
    ranges: Tuple[Tuple[int, int], ...]  # executable [start, end) in the process
    symbols: Tuple[Tuple[int, str], ...]  # (vaddr, name), sorted
    sizes: Tuple[int, ...] = ()  # per symbol; 0: unknown (then only MAX_SYMBOL_DISTANCE limits it)
    first_vaddr: int = 0  # page of the first PT_LOAD at file offset 0 (to rebase in another process)
    _starts: Tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(v for v, _ in self.symbols))

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @classmethod
    def of(
        cls,
        pid: int,
        mapped: MappedLibrary,
        extra: Sequence[Tuple[int, str]] = (),
        elf: Optional[Elf] = None,
        symbols_from: Optional[LibraryText] = None,
    ) -> LibraryText:
        """From the ELF's functions (.symtab and .dynsym) plus `extra` (vaddr, name) pairs, which win
        at their address (the agent names trampolines' implementations after the API). With
        `symbols_from` (the same file in another process), only the placement is read again."""
        if symbols_from is not None:
            maps = [m for m in _read_maps(pid) if m.path == mapped.path]
            first = symbols_from.first_vaddr
            bias = next((m.start - first for m in maps if m.offset == 0), 0)
            ranges = tuple((m.start, m.end) for m in maps if "x" in m.perms)
            return cls(symbols_from.path, bias, ranges, symbols_from.symbols, symbols_from.sizes, first)
        if elf is None:
            try:
                elf = Elf(mapped.host_path)
            except (OSError, ElfError):
                elf = None
        maps = [m for m in _read_maps(pid) if m.path == mapped.path]
        bias = first = 0
        if elf is not None:  # as cpython._load_bias: the offset-0 mapping minus the first PT_LOAD
            first = min((v for v, off, _n in elf._loads if off == 0), default=0) & ~0xFFF
            bias = next((m.start - first for m in maps if m.offset == 0), 0)
        ranges = tuple((m.start, m.end) for m in maps if "x" in m.perms)
        best: Dict[int, Tuple[int, str, int]] = {}  # vaddr -> (rank, name, size): extra, then shortest
        for name, sym in elf.symbols.items() if elf is not None else ():
            key = (1, name, sym.size)
            old = best.get(sym.vaddr)
            if old is None or (key[0], len(name), name) < (old[0], len(old[1]), old[1]):
                best[sym.vaddr] = key
        for vaddr, name in extra:
            best[vaddr] = (0, name, 0)
        order = sorted(best)
        return cls(
            mapped.path,
            bias,
            ranges,
            tuple((v, best[v][1]) for v in order),
            tuple(best[v][2] for v in order),
            first,
        )

    def symbolise(self, addr: int) -> NativeFrame:
        """The function holding process address `addr` (nearest preceding symbol that can hold it)."""
        vaddr = addr - self.bias
        i = bisect.bisect_right(self._starts, vaddr) - 1
        for j in range(i, max(i - 4, -1), -1):  # a small symbol may sit inside a bigger one
            off = vaddr - self._starts[j]
            size = self.sizes[j] if j < len(self.sizes) else 0
            if (size == 0 and off <= MAX_SYMBOL_DISTANCE and j == i) or 0 <= off <= size:
                return NativeFrame(self.name, self.symbols[j][1], off)
        return NativeFrame(self.name, None, vaddr)


# ---- native frames --------------------------------------------------------------------------------


def _ff2_length(code: bytes, p: int) -> int:
    """Length of an `FF /2` (call r/m64) instruction whose FF byte is at code[p]; 0 if it is not one."""
    if p + 1 >= len(code) or code[p] != 0xFF:
        return 0
    modrm = code[p + 1]
    if (modrm >> 3) & 7 != 2:
        return 0
    mod, rm = modrm >> 6, modrm & 7
    n = 2
    if mod == 3:
        return n
    if rm == 4:  # SIB byte
        if p + 2 >= len(code):
            return 0
        n += 1
        if mod == 0 and code[p + 2] & 7 == 5:
            n += 4
    elif mod == 0 and rm == 5:  # rip-relative: call *sym@GOTPCREL(%rip)
        n += 4
    return n + (1 if mod == 1 else 4 if mod == 2 else 0)


def follows_call(code: bytes) -> bool:
    """Whether `code`, the bytes just before a candidate return address, ends with a call:
    E8 rel32, or FF /2 (register, memory, rip-relative), with an optional REX or notrack prefix."""
    n = len(code)
    if n >= 5 and code[n - 5] == 0xE8:
        return True
    for k in range(2, min(n, 8) + 1):
        p = n - k
        if _ff2_length(code, p) == k:
            return True
        if (0x40 <= code[p] <= 0x4F or code[p] == 0x3E) and _ff2_length(code, p + 1) == k - 1:
            return True
    return False


def _pread(fd: int, addr: int, n: int) -> bytes:
    try:
        return os.pread(fd, n, addr)
    except (OSError, OverflowError, ValueError):
        return b""


class _Text:
    """The executable file mappings of one process, classified for one scan."""

    LIB, PY, LIBC, OTHER = 0, 1, 2, 3

    def __init__(
        self, maps: List[_Map], libraries: Sequence[LibraryText], python: Optional[Interpreter]
    ) -> None:
        by_path = {lt.path: lt for lt in libraries}
        py_path = python.binary.path if python is not None else None
        rows: List[Tuple[int, int, int, str, Optional[LibraryText]]] = []
        for m in maps:
            if "x" not in m.perms or not (m.path.startswith("/") or m.path == "[vdso]"):
                continue
            lt = by_path.get(m.path) or next(
                (x for x in libraries if any(lo <= m.start < hi for lo, hi in x.ranges)), None
            )
            base = os.path.basename(m.path)
            if lt is not None:
                kind = self.LIB
            elif m.path == py_path:
                kind = self.PY
            elif base.startswith(_LIBC_LIKE):
                kind = self.LIBC
            else:
                kind = self.OTHER
            rows.append((m.start, m.end, kind, base, lt))
        rows.sort()
        self.rows = rows
        self.starts = [r[0] for r in rows]
        self.buckets = {b for lo, hi, *_ in rows for b in range(lo >> _BUCKET, ((hi - 1) >> _BUCKET) + 1)}
        self.plausible: Dict[int, bool] = {}  # return address -> follows a call (shared by threads)

    def row(self, addr: int) -> Optional[Tuple[int, int, int, str, Optional[LibraryText]]]:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.rows[i][1]:
            return self.rows[i]
        return None

    def _follows_call(self, fd: int, addr: int, lo: int) -> bool:
        ok = self.plausible.get(addr)
        if ok is None:
            start = max(lo, addr - 8)
            ok = self.plausible[addr] = X86_64 and follows_call(_pread(fd, start, addr - start))
        return ok

    def walk(
        self, fd: int, sp: int, pc: int, stack_end: int, stack_bytes: int
    ) -> Tuple[Tuple[NativeFrame, ...], Optional[str]]:
        """(library frames innermost first, the file the thread started in) from a stack scan."""
        lo = sp & ~7
        hi = min(lo + stack_bytes, stack_end)
        data = _pread(fd, lo, hi - lo) if hi > lo else b""
        vals = struct.unpack_from(f"<{len(data) // 8}Q", data)
        buckets = self.buckets
        cands = [v for v in set(vals) if v >> _BUCKET in buckets]
        cands.sort(key=vals.index)  # innermost (lowest address) first; index() runs in C
        frames: List[NativeFrame] = []
        cut = False
        outer: Optional[str] = None
        pc_row = self.row(pc)
        seq = [(pc, pc_row)] if pc_row is not None else []
        for v in cands:
            r = self.row(v)
            if r is not None and self._follows_call(fd, v, r[0]):
                seq.append((v, r))
        for addr, r in seq:
            kind, lt = r[2], r[4]
            if kind != self.LIBC:
                outer = r[3]
            if cut:
                continue
            if kind == self.PY:  # back in the interpreter: library addresses further out are stale
                cut = True
            elif lt is not None and len(frames) < MAX_NATIVE_FRAMES:
                frames.append(lt.symbolise(addr))
        # the outermost frame is the thread's start only when the scan reached the stack's top
        started = outer if data and lo + len(data) >= stack_end else None
        return tuple(frames), started


# ---- /proc/PID/task ------------------------------------------------------------------------------


@dataclass
class _Raw:
    name: str = "?"
    state: str = "?"
    cpu_ns: int = 0
    syscall: Optional[str] = None
    sp: int = 0
    pc: int = 0


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode(errors="replace")
    except OSError:
        return None


def _read_syscall(task: str, raw: _Raw) -> None:
    text = _read_text(f"{task}/syscall")
    raw.syscall, raw.sp, raw.pc = None, 0, 0
    if text is None:
        return
    parts = text.split()
    if parts == ["running"]:
        raw.syscall = "running"
        return
    try:
        nr = int(parts[0])
        raw.sp, raw.pc = int(parts[-2], 16), int(parts[-1], 16)
    except (IndexError, ValueError):
        return
    raw.syscall = syscall_name(nr) if nr >= 0 else None  # -1: stopped in user space


def _read_thread(task: str) -> Optional[_Raw]:
    stat = _read_text(f"{task}/stat")
    if stat is None:
        return None
    raw = _Raw()
    head, _, tail = stat.rpartition(")")
    raw.name = head.partition("(")[2]
    fields = tail.split()
    if fields:
        raw.state = fields[0]
    sched = _read_text(f"{task}/schedstat")
    try:
        raw.cpu_ns = (
            int(sched.split()[0]) if sched else (int(fields[11]) + int(fields[12])) * 10**9 // _CLK_TCK
        )
    except (IndexError, ValueError):
        pass
    _read_syscall(task, raw)
    return raw


def sp_pc(pid: int, tid: int) -> Optional[Tuple[int, int]]:
    """(stack pointer, instruction pointer) of a thread blocked in a syscall; None when it is
    running (or gone): a cheap check that a blocked thread still sits where it was."""
    raw = _Raw()
    _read_syscall(f"/proc/{pid}/task/{tid}", raw)
    return (raw.sp, raw.pc) if raw.sp else None


def thread_alive(pid: int, tid: int) -> bool:
    return os.path.exists(f"/proc/{pid}/task/{tid}")


def _tids(pid: int) -> List[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit())[:MAX_THREADS]
    except OSError:
        return []


# ---- the scan ------------------------------------------------------------------------------------


def scan(
    pid: int,
    libraries: Sequence[LibraryText],
    python: Optional[Interpreter] = None,
    stack_bytes: int = STACK_BYTES,
    retry_s: float = RETRY_S,
) -> ProcessScan:
    """Every thread of `pid`: state, syscall, frames inside `libraries`, and its Python stack."""
    raws: Dict[int, _Raw] = {}
    for tid in _tids(pid):
        raw = _read_thread(f"/proc/{pid}/task/{tid}")
        if raw is not None:
            raws[tid] = raw
    deadline = time.monotonic() + retry_s
    running = [tid for tid, r in raws.items() if r.syscall == "running"]
    while running and time.monotonic() < deadline:
        time.sleep(retry_s / 10)
        for tid in running:
            again = _read_thread(f"/proc/{pid}/task/{tid}")
            if again is not None:
                raws[tid] = again
        running = [tid for tid in running if raws[tid].syscall == "running"]
    native: Dict[int, Tuple[Tuple[NativeFrame, ...], Optional[str]]] = {}
    maps = _read_maps(pid)
    if X86_64 and maps and any(r.sp for r in raws.values()):
        text = _Text(maps, libraries, python)
        starts = [m.start for m in maps]
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                for tid, r in raws.items():
                    i = bisect.bisect_right(starts, r.sp) - 1
                    if r.sp and i >= 0 and r.sp < maps[i].end:
                        native[tid] = text.walk(fd, r.sp, r.pc, maps[i].end, stack_bytes)
            finally:
                os.close(fd)
    pys = _python_stacks(python, list(raws)) if python is not None else {}
    threads = tuple(
        ThreadScan(
            tid,
            r.name,
            r.state,
            r.syscall,
            native.get(tid, ((), None))[0],
            pys.get(tid, ()),
            r.cpu_ns,
            native.get(tid, ((), None))[1],
        )
        for tid, r in raws.items()
    )
    return ProcessScan(pid, threads)
