"""argus.agent.threadscan against real processes: a C library built here (with and without .symtab)
called from Python through ctypes, Python stacks with current lines against sys._current_frames()
of every interpreter present, samples of a thread that alternates, processes that exit mid-scan,
and the pieces (call decoding, symbolising, line tables, offsets against the headers)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from argus.agent import threadscan
from argus.agent.threadscan import (
    LINE_OFFSETS,
    LibraryText,
    NativeFrame,
    ProcessScan,
    blocked_threads,
    follows_call,
    line_pep657,
    scan,
)
from argus.probes import cpython
from argus.probes.base import find_library
from argus.probes.elf import Elf
from tests.helpers import REPO_ROOT, cpython_header_sets
from tests.nvidia_wheels import Wheel, fetch

TARGETS = REPO_ROOT / "tests" / "targets"
TARGET = TARGETS / "threadscan_target.py"
LINES_TARGET = TARGETS / "threadscan_lines.py"
LIB_SOURCE = TARGETS / "threadscan_lib.c"
PYENV = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))) / "versions"
SYSTEM_PY = "/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else sys.executable

needs_linux_x86 = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() != "x86_64",
    reason="stack scanning decodes x86-64 calls and reads /proc",
)
needs_cc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to build the test library")


def marker_line(path: Path, marker: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


# ---- children ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The test library twice: with its .symtab, and stripped (-s: only .dynsym's exports left)."""
    d = tmp_path_factory.mktemp("tslib")
    out = {}
    for kind, extra in (("symtab", []), ("stripped", ["-s"])):
        so = d / f"libtsblock_{kind}.so"
        cmd = ["gcc", "-O2", "-shared", "-fPIC", *extra, "-o", str(so), str(LIB_SOURCE), "-lpthread"]
        subprocess.run(cmd, check=True, capture_output=True)
        out[kind] = so
    return out


def mem_unreadable(pid: int) -> Optional[str]:
    """Why /proc/PID/mem of a child cannot be read here, or None."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            start = int(next(line for line in f if " r" in line[17:]).split("-")[0], 16)
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        try:
            os.pread(fd, 8, start)
        finally:
            os.close(fd)
    except (OSError, StopIteration) as e:
        return f"cannot read /proc/{pid}/mem of a child ({e}): needs root or ptrace rights"
    return None


class Child:
    def __init__(self, argv: List[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"child failed: {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.info = json.loads(line)
        self.pid = self.proc.pid
        reason = mem_unreadable(self.pid)
        if reason:
            self.stop()
            pytest.skip(reason)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def child() -> Iterator[Callable[..., Child]]:
    started: List[Child] = []

    def start(*argv: str) -> Child:
        c = Child(list(argv))
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def target(child: Callable[..., Child], lib: Path, mode: str, control: str = "") -> Tuple[Child, LibraryText]:
    c = child(SYSTEM_PY, str(TARGET), str(lib), mode, *([control] if control else []))
    mapped = find_library(c.pid, r"libtsblock_\w+\.so")
    assert mapped is not None
    return c, LibraryText.of(c.pid, mapped)


def settled(
    pid: int, libs: List[LibraryText], ok: Callable[[ProcessScan], bool], py: Optional[cpython.Interpreter]
) -> ProcessScan:
    """Scan until `ok` holds (threads reach their blocking calls a little after they start)."""
    deadline = time.monotonic() + 10
    while True:
        s = scan(pid, libs, py)
        if ok(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


# ---- blocked threads ---------------------------------------------------------------------------------


@needs_linux_x86
@needs_cc
@pytest.mark.parametrize("kind", ["symtab", "stripped"])
def test_blocked_thread_in_library_and_sleeping_thread(
    child: Callable[..., Child], libs: Dict[str, Path], kind: str
) -> None:
    if kind == "stripped":  # the name can then only come from .dynsym
        assert "worker_main" not in Elf(str(libs[kind])).symbols
        assert "worker_main" in Elf(str(libs["symtab"])).symbols
    c, lt = target(child, libs[kind], "block")
    py = cpython.inspect(c.pid)
    assert py is not None
    blocker, sleeper = c.info["blocker"], c.info["sleeper"]

    def ready(s: ProcessScan) -> bool:
        b, z = s.thread(blocker), s.thread(sleeper)
        return b is not None and b.syscall == "futex" and z is not None and z.syscall == "clock_nanosleep"

    s = settled(c.pid, [lt], ready, py)
    b, z, main = s.thread(blocker), s.thread(sleeper), s.thread(c.pid)
    assert b is not None and z is not None and main is not None
    assert b.syscall == "futex" and b.state == "S"
    assert b.native and b.native[0].symbol == "blocker" and b.native[0].library == lt.name
    assert 0 < b.native[0].offset < 256
    assert b.python[0] == f"wait_here ({TARGET}:{marker_line(TARGET, '@blocker')})"
    assert b.python[-1].startswith("Thread._bootstrap (") and len(b.python) == 4
    assert b.started_in == os.path.basename(os.path.realpath(SYSTEM_PY)) and b.in_library

    assert z.syscall == "clock_nanosleep" and z.native == ()  # stale library addresses stay out
    assert z.python[0] == f"sleepy ({TARGET}:{marker_line(TARGET, '@sleeper')})"
    assert main.syscall == "read" and main.python == (f"<module> ({TARGET}:{marker_line(TARGET, '@main')})",)

    assert s.blocked_in() == (blocker, NativeFrame(lt.name, "blocker", b.native[0].offset))
    here = f"wait_here (threadscan_target.py:{marker_line(TARGET, '@blocker')})"
    assert s.where() == f"blocked in blocker ({lt.name}) from {here}"
    assert all(t.cpu_ns > 0 for t in s.threads)

    bare = scan(c.pid, [lt])  # without the interpreter: the same native frames, no Python stacks
    bb = bare.thread(blocker)
    assert bb is not None and bb.native[:1] == b.native[:1] and bb.python == ()
    assert bare.where() == f"blocked in blocker ({lt.name})"


@needs_linux_x86
@needs_cc
def test_library_own_thread_never_counts(child: Callable[..., Child], libs: Dict[str, Path]) -> None:
    """A thread the library started (as NCCL's proxy or CUDA's event threads) always sits in it."""
    c, lt = target(child, libs["stripped"], "worker")
    py = cpython.inspect(c.pid)

    def ready(s: ProcessScan) -> bool:
        return any(t.native for t in s.threads) and any(t.syscall == "clock_nanosleep" for t in s.threads)

    s = settled(c.pid, [lt], ready, py)
    (worker,) = [t for t in s.threads if t.native]
    assert worker.native[0].symbol == "blocker" and worker.syscall == "futex" and worker.python == ()
    assert worker.started_in == lt.name and worker.library_owned and not worker.in_library
    assert s.blocked_in() is None
    assert s.where() == f"in <module> (threadscan_target.py:{marker_line(TARGET, '@main')}), read"
    assert blocked_threads([s, s]) == {}


@needs_linux_x86
@needs_cc
def test_blocked_threads_keeps_only_the_steadily_blocked(
    child: Callable[..., Child], libs: Dict[str, Path], tmp_path: Path
) -> None:
    control = tmp_path / "spin"
    c, lt = target(child, libs["symtab"], "alternate", str(control))
    py = cpython.inspect(c.pid)
    blocker, alternator = c.info["blocker"], c.info["alternator"]

    def napping(s: ProcessScan) -> bool:
        b, a = s.thread(blocker), s.thread(alternator)
        return b is not None and b.in_library and a is not None and a.in_library

    first = settled(c.pid, [lt], napping, py)
    a1 = first.thread(alternator)
    assert a1 is not None and a1.native[0].symbol == "napper" and a1.syscall == "clock_nanosleep"
    assert a1.python[0] == f"alternate ({TARGET}:{marker_line(TARGET, '@napper')})"
    control.touch()  # now it spins in Python (on a loaded host it may take a while to notice)

    def spinning(s: ProcessScan) -> bool:
        a = s.thread(alternator)
        return a is not None and not a.in_library

    settled(c.pid, [lt], spinning, py)
    time.sleep(0.3)  # CPU time to show
    second = scan(c.pid, [lt], py)
    a2 = second.thread(alternator)
    assert a2 is not None and not a2.in_library
    control.unlink()
    time.sleep(0.3)
    third = settled(c.pid, [lt], napping, py)

    b1, b3 = first.thread(blocker), third.thread(blocker)
    assert b1 is not None and b3 is not None
    assert blocked_threads([first, second, third]) == {
        blocker: NativeFrame(lt.name, "blocker", b1.native[0].offset)
    }
    assert set(blocked_threads([first, third])) == {blocker, alternator}
    assert a2.cpu_ns - a1.cpu_ns > 100_000_000  # spinning shows as CPU time; a blocked thread's does not grow
    assert b3.cpu_ns - b1.cpu_ns < 10_000_000


NCCL_THREADS = Wheel(
    "nvidia-nccl-cu13==2.32.3", "nvidia/nccl/lib/libnccl.so.2", 305
)  # threads via std::thread
NCCL_UNIQUE_ID = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
uid = ctypes.create_string_buffer(128)
print(lib.ncclGetUniqueId(uid), flush=True)  # starts NCCL's bootstrap root thread: it waits in accept
sys.stdin.read()
"""


@needs_linux_x86
@pytest.mark.slow
def test_real_nccl_bootstrap_thread_is_the_librarys_own(child: Callable[..., Child]) -> None:
    """NVIDIA's real libnccl (no GPU needed): its bootstrap thread is found inside it, named, and
    not taken for a blocked rank, though it was started through libstdc++'s std::thread."""
    path, why = fetch(NCCL_THREADS)
    if path is None:
        pytest.skip(why)
    c = child(SYSTEM_PY, "-c", NCCL_UNIQUE_ID, str(path))
    assert c.info == 0
    mapped = find_library(c.pid, r"libnccl\.so\.2")
    assert mapped is not None
    lt = LibraryText.of(c.pid, mapped)
    s = settled(c.pid, [lt], lambda s: any(t.syscall == "accept" for t in s.threads), cpython.inspect(c.pid))
    (root,) = [t for t in s.threads if t.native]
    assert root.syscall == "accept" and root.started_in == "libnccl.so.2" and root.library_owned
    assert any("bootstrapRoot" in (f.symbol or "") for f in root.native)
    assert s.blocked_in() is None and s.where().startswith("in <module> (<string>:")


# ---- vanishing processes -------------------------------------------------------------------------


def test_scan_of_a_gone_pid_is_empty() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    s = scan(p.pid, [])
    assert s == ProcessScan(p.pid, ()) and s.blocked_in() is None
    assert s.where() == "no threads (the process has exited)"
    assert blocked_threads([s]) == {}


@needs_linux_x86
@needs_cc
@pytest.mark.parametrize("hook", ["_read_thread", "_tids", "walk", "_python_stacks"])
def test_process_exiting_mid_scan_returns_what_was_read(
    child: Callable[..., Child], libs: Dict[str, Path], monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    c, lt = target(child, libs["symtab"], "block")
    py = cpython.inspect(c.pid)
    time.sleep(0.2)
    owner = threadscan._Text if hook == "walk" else threadscan
    real = getattr(owner, hook)

    def killing(*args: object, **kwargs: object) -> object:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()  # reaped: every /proc read from here on fails
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, hook, killing)
    s = scan(c.pid, [lt], py)
    assert s.pid == c.pid
    s.where()
    s.blocked_in()
    assert c.proc.poll() is not None


# ---- Python stacks and line numbers ------------------------------------------------------------------


def interpreters() -> List[Tuple[str, str]]:
    found = [("system", os.path.realpath(SYSTEM_PY))]
    for minor in range(9, 14):
        for d in sorted(PYENV.glob(f"3.{minor}.*")):
            exe = d / "bin" / f"python3.{minor}"
            if exe.exists():
                found.append((f"pyenv {d.name}", str(exe)))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("label,exe", interpreters())
def test_python_stacks_match_the_interpreters_own(child: Callable[..., Child], label: str, exe: str) -> None:
    """Every parked thread's frames, names and current lines as sys._current_frames() gives them."""
    c = child(exe, str(LINES_TARGET))
    py = cpython.inspect(c.pid)
    assert py is not None
    s = scan(c.pid, [], py)
    assert len(c.info) == 6
    for tid, frames in c.info.items():
        t = s.thread(int(tid))
        assert t is not None, (label, tid)
        want = [f"{name} ({file}:{line})" for name, file, line in frames]
        got = []
        for q in t.python:  # before 3.11 the qualname is rebuilt from the source; compare its last part
            qualname, _, where = q.rpartition(" (")
            got.append(f"{qualname.split('.')[-1]} ({where}")
        assert got == want, label
    qualnames = {q.rpartition(" (")[0] for t in s.threads for q in t.python}
    assert {"Holder.method", "Holder.decorated", "lambda_caller.<locals>.<lambda>", "gen"} <= qualnames


def _code_objects(mod: types.ModuleType) -> Iterator[types.CodeType]:
    """Every code object of a module's source, nested ones included."""
    path = mod.__file__
    assert path is not None
    todo = [compile(Path(path).read_text(), path, "exec")]
    while todo:
        co = todo.pop()
        yield co
        todo += [k for k in co.co_consts if isinstance(k, types.CodeType)]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the PEP 657 location table is 3.11+")
def test_pep657_line_table_matches_co_lines() -> None:
    import argparse

    n = 0
    for mod in (argparse, threadscan):
        for co in _code_objects(mod):
            for start, end, line in co.co_lines():
                for addr in range(start, end, 2):
                    assert line_pep657(co.co_linetable, co.co_firstlineno, addr) == line, (co, addr)
                    n += 1
    assert n > 5000


def test_line_offsets_match_the_running_interpreter() -> None:
    lo = LINE_OFFSETS[sys.version_info[:2]]
    if lo.code_adaptive != -1:  # tp_basicsize of code is offsetof(PyCodeObject, co_code_adaptive)
        assert types.CodeType.__basicsize__ == lo.code_adaptive


DERIVE_C = r"""
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include <frameobject.h>
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#include "internal/pycore_code.h"
#endif
int main(void) {
#if PY_VERSION_HEX >= 0x030D0000
    printf("%ld -1 ", (long)offsetof(_PyInterpreterFrame, instr_ptr));
#elif PY_VERSION_HEX >= 0x030B0000
    printf("%ld -1 ", (long)offsetof(_PyInterpreterFrame, prev_instr));
#elif PY_VERSION_HEX >= 0x030A0000
    printf("%ld %ld ", (long)offsetof(PyFrameObject, f_lasti), (long)offsetof(PyFrameObject, f_lineno));
#else /* 3.9's f_lineno is valid only while tracing: not used */
    printf("%ld -1 ", (long)offsetof(PyFrameObject, f_lasti));
#endif
#if PY_VERSION_HEX >= 0x030A0000
    printf("%ld ", (long)offsetof(PyCodeObject, co_linetable));
#else
    printf("%ld ", (long)offsetof(PyCodeObject, co_lnotab));
#endif
#if PY_VERSION_HEX >= 0x030B0000
    printf("%ld ", (long)offsetof(PyCodeObject, co_code_adaptive));
#else
    printf("-1 ");
#endif
    printf("%ld %ld %ld\n", (long)offsetof(PyVarObject, ob_size), (long)offsetof(PyVarObject, ob_size),
           (long)offsetof(PyBytesObject, ob_sval));
    return 0;
}
"""


def _header_sets() -> List[Tuple[str, Tuple[int, int], Tuple[str, ...]]]:
    return cpython_header_sets(LINE_OFFSETS)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize(
    "label,version,include",
    _header_sets()
    or [pytest.param("", (0, 0), (), marks=pytest.mark.skip(reason="no CPython headers here"))],
)
def test_line_offsets_match_each_interpreters_headers(
    tmp_path: Path, label: str, version: Tuple[int, int], include: Tuple[str, ...]
) -> None:
    src, exe = tmp_path / "off.c", tmp_path / "off"
    src.write_text(DERIVE_C)
    subprocess.run(["cc", "-w", *[f"-I{d}" for d in include], "-o", str(exe), str(src)], check=True)
    got = [
        int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    ]
    lo = LINE_OFFSETS[version]
    want = [
        lo.frame_instr,
        lo.frame_lineno,
        lo.code_linetable,
        lo.code_adaptive,
        lo.code_size,
        lo.bytes_size,
        lo.bytes_data,
    ]
    assert got == want, label


# ---- pieces -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code,ok",
    [
        ("e8 10 20 30 40", True),  # call rel32
        ("ff d0", True),  # call *%rax
        ("41 ff d3", True),  # call *%r11
        ("ff 15 00 10 00 00", True),  # call *x@GOTPCREL(%rip)
        ("ff 50 08", True),  # call *8(%rax)
        ("ff 54 24 08", True),  # call *8(%rsp) (SIB)
        ("ff 90 00 01 00 00", True),  # call *0x100(%rax)
        ("ff 94 24 00 01 00 00", True),  # call *0x100(%rsp)
        ("41 ff 54 24 08", True),  # call *8(%r12)
        ("ff 10", True),  # call *(%rax)
        ("ff e0", False),  # jmp *%rax (FF /4)
        ("ff 25 00 10 00 00", False),  # jmp *x(%rip)
        ("48 89 c7 90", False),
        ("", False),
    ],
)
def test_follows_call(code: str, ok: bool) -> None:
    raw = bytes.fromhex(code)
    assert follows_call(b"\x90\x90\x90" + raw if raw else raw) is ok


def test_symbolise_nearest_symbol_that_can_hold_the_address() -> None:
    lt = LibraryText(
        "/x/libnccl.so.2",
        bias=0x7F0000000000,
        ranges=((0x7F0000001000, 0x7F0000400000),),
        symbols=((0x1000, "ncclAllReduce"), (0x2000, "small"), (0x3000, "sizeless")),
        sizes=(0x800, 0x10, 0),
    )
    b = 0x7F0000000000
    assert lt.symbolise(b + 0x1010) == NativeFrame("libnccl.so.2", "ncclAllReduce", 0x10)
    assert lt.symbolise(b + 0x1800) == NativeFrame(
        "libnccl.so.2", "ncclAllReduce", 0x800
    )  # a call at its end
    assert lt.symbolise(b + 0x1900) == NativeFrame("libnccl.so.2", None, 0x1900)  # past its end: unnamed code
    assert lt.symbolise(b + 0x2400) == NativeFrame("libnccl.so.2", None, 0x2400)
    assert lt.symbolise(b + 0x3000 + 0x1000) == NativeFrame("libnccl.so.2", "sizeless", 0x1000)
    assert lt.symbolise(b + 0x3000 + (2 << 20)).symbol is None  # implausibly far
    assert lt.symbolise(b + 0x10).symbol is None
    assert NativeFrame("libnccl.so.2", None, 0x1900).label() == "libnccl.so.2+0x1900"


@needs_linux_x86
@needs_cc
def test_library_text_of_prefers_extra_names(child: Callable[..., Child], libs: Dict[str, Path]) -> None:
    c, lt = target(child, libs["symtab"], "worker")
    mapped = find_library(c.pid, r"libtsblock_\w+\.so")
    assert mapped is not None
    elf = Elf(mapped.host_path)
    blocker = elf.symbols["blocker"]
    named = LibraryText.of(c.pid, mapped, extra=[(blocker.vaddr, "cuStreamSynchronize")], elf=elf)
    assert lt.ranges and lt.bias == named.bias and lt.bias % 4096 == 0
    assert named.symbolise(named.bias + blocker.vaddr + 4) == NativeFrame(lt.name, "cuStreamSynchronize", 4)
    assert lt.symbolise(lt.bias + blocker.vaddr + 4) == NativeFrame(lt.name, "blocker", 4)


# ---- cost ----------------------------------------------------------------------------------------------


@needs_linux_x86
@needs_cc
def test_scan_of_a_rank_sized_process_is_cheap(child: Callable[..., Child], libs: Dict[str, Path]) -> None:
    c, lt = target(child, libs["symtab"], "many")
    py = cpython.inspect(c.pid)
    settled(c.pid, [lt], lambda s: s.blocked_in() is not None, None)
    times, with_py = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        s = scan(c.pid, [lt])
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        scan(c.pid, [lt], py)
        with_py.append(time.perf_counter() - t0)
    assert len(s.threads) >= 20
    native_ms, py_ms = statistics.median(times) * 1e3, statistics.median(with_py) * 1e3
    print(f"scan of {len(s.threads)} threads: {native_ms:.1f} ms native, {py_ms:.1f} ms with Python stacks")
    assert native_ms < 50
