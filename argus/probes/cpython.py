"""CPython in a running process: which interpreter, where its runtime is, its threads, its code.

The Python channel (argus/bpf/python.bpf.c) walks frames in the kernel; everything that needs names is
done here, from user space, by reading the process's memory (/proc/PID/mem): the tid -> thread
state map the walker needs (from the interpreter's thread list: works for every supported
version, for threads that released the GIL, and where the current thread state is thread-local),
and code object -> (qualname, file, first line) for the stacks it stored.

Supported: CPython 3.9-3.13 with the GIL, from distro packages (Debian: USDT probes, no frame
pointers), pyenv, conda or python.org builds, with libpython shared or linked in. Anything else
that is recognisably Python raises `Unsupported` naming the range.
"""

from __future__ import annotations

import ast
import os
import re
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Dict, List, Optional, Tuple

from argus.errors import Unsupported
from argus.probes.base import Channel, MappedLibrary, _maps, find_library, host_path
from argus.probes.cpython_offsets import NONE, SUPPORTED, SUPPORTED_TEXT, TABLE, Offsets
from argus.probes.elf import Elf, ElfError

CHANNEL = Channel(name="python", library_re=r"", source="python.bpf.c", specs=(), macro="ARGUS_PYTHON")

_LIBPYTHON = re.compile(r"libpython(\d+)\.(\d+)[a-z]*\.so")
_EXE = re.compile(r"python(\d+)\.(\d+)([a-z]*)$")
GLIBC_PTHREAD_TID = 0x2D0  # struct pthread.tid in glibc 2.28-2.39, x86-64 (checked per process)


@dataclass(frozen=True)
class Frame:
    qualname: str
    filename: str
    line: int

    def label(self) -> str:
        return self.qualname


@dataclass
class Interpreter:
    pid: int
    version: Tuple[int, int]
    binary: MappedLibrary  # the file that defines _PyRuntime (libpython or the executable)
    elf: Elf
    bias: int  # load address minus ELF virtual address
    runtime: int  # address of _PyRuntime in the process
    offsets: Offsets
    free_threaded: bool = False
    debug_offsets: bool = False  # the offsets came from the process's _Py_DebugOffsets

    @property
    def version_text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


class Mem:
    """Reads of another process's memory (None when unmapped)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._f: Optional[BinaryIO] = open(f"/proc/{pid}/mem", "rb", buffering=0)
        except OSError:  # gone, or not ours to read: every read is None
            self._f = None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()

    def read(self, addr: int, n: int) -> Optional[bytes]:
        if addr <= 0 or n <= 0 or self._f is None:
            return None
        try:
            self._f.seek(addr)
            data = self._f.read(n)
        except (OSError, ValueError, OverflowError):
            return None
        return data if len(data) == n else None

    def u64(self, addr: int) -> Optional[int]:
        b = self.read(addr, 8)
        return struct.unpack("<Q", b)[0] if b else None

    def i32(self, addr: int) -> Optional[int]:
        b = self.read(addr, 4)
        return struct.unpack("<i", b)[0] if b else None

    def cstr(self, addr: int, limit: int = 256) -> Optional[str]:
        b = self.read(addr, limit)
        if b is None:
            return None
        return b.split(b"\0", 1)[0].decode(errors="replace")


# ---- finding the interpreter ---------------------------------------------------------------------


def _load_bias(pid: int, lib: MappedLibrary, elf: Elf) -> int:
    first = min((v for v, off, _n in elf._loads if off == 0), default=0) & ~0xFFF
    for line in _maps(pid).splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].strip() == lib.path and int(parts[2], 16) == 0:
            return int(parts[0].split("-")[0], 16) - first
    return 0


def _version_from_names(*names: str) -> Optional[Tuple[int, int]]:
    for name in names:
        m = _LIBPYTHON.search(name) or _EXE.search(name)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def _exe(pid: int) -> Optional[MappedLibrary]:
    try:
        path = os.readlink(f"/proc/{pid}/exe")
        st = os.stat(f"/proc/{pid}/exe")
    except OSError:
        return None
    # through the process's root: the same path here may be another file (a container's image has
    # its own python); /proc/PID/exe when that is not the file it runs (deleted, replaced)
    host = host_path(pid, path)
    try:
        same = os.path.samestat(os.stat(host), st)
    except OSError:
        same = False
    return MappedLibrary(path, host if same else f"/proc/{pid}/exe", (st.st_dev, st.st_ino))


def detect(pid: int) -> Optional[MappedLibrary]:
    """The file holding the interpreter of `pid` (libpython or the executable), or None."""
    lib = find_library(pid, r"libpython\d+\.\d+[a-z]*\.so(\.[\d.]+)?")
    if lib is not None:
        return lib
    exe = _exe(pid)
    if exe is None:
        return None
    base = os.path.basename(exe.path)
    if _EXE.search(base) or base.startswith("python"):
        return exe
    try:
        elf = Elf(exe.host_path)
    except (OSError, ElfError):
        return None
    return exe if "Py_Initialize" in elf.symbols else None


def inspect(pid: int) -> Optional[Interpreter]:
    """The interpreter of `pid`; None when the process is not Python; `Unsupported` outside 3.9-3.13."""
    lib = detect(pid)
    if lib is None:
        return None
    try:
        elf = Elf(lib.host_path)
    except (OSError, ElfError):
        return None
    exe = _exe(pid)
    version = None
    ver_sym = elf.data_symbols.get("Py_Version")
    if ver_sym is not None:
        raw = elf.read(ver_sym.offset, 4)
        if len(raw) == 4:
            hexv = struct.unpack("<I", raw)[0]
            version = (hexv >> 24, (hexv >> 16) & 0xFF)
    if version is None:
        version = _version_from_names(lib.path, os.path.realpath(lib.host_path), exe.path if exe else "")
    runtime_sym = elf.data_symbols.get("_PyRuntime")
    if version is None or version not in SUPPORTED or runtime_sym is None:
        if version is None and runtime_sym is None and "Py_Initialize" not in elf.symbols:
            return None  # not Python after all
        shown = f"{version[0]}.{version[1]}" if version else "of unknown version"
        raise Unsupported(
            f"pid {pid} runs Python {shown} ({lib.path}); "
            f"the Python channel supports CPython {SUPPORTED_TEXT}",
            "--no-python probes the other channels of this process",
        )
    bias = _load_bias(pid, lib, elf)
    interp = Interpreter(pid, version, lib, elf, bias, bias + runtime_sym.vaddr, TABLE[version])
    if version >= (3, 13):
        _apply_debug_offsets(interp)
    if interp.free_threaded:
        raise Unsupported(
            f"pid {pid} runs a free-threaded CPython {interp.version_text}; the Python channel supports "
            f"CPython {SUPPORTED_TEXT} with the GIL",
            "--no-python probes the other channels of this process",
        )
    return interp


def _apply_debug_offsets(interp: Interpreter) -> None:
    """3.13+: the runtime starts with _Py_DebugOffsets ("xdebugpy"); prefer its values."""
    mem = Mem(interp.pid)
    try:
        raw = mem.read(interp.runtime, 8 * 60)
    finally:
        mem.close()
    if raw is None or raw[:8] != b"xdebugpy":
        return
    q = struct.unpack_from("<59Q", raw, 8)
    # version, free_threaded, runtime_state[3], interpreter_state[13], thread_state[9],
    # interpreter_frame[6], code_object[10], pyobject[2], type_object[4], ...
    interp.free_threaded = bool(q[1])
    rt, it, ts, fr, co = q[2:5], q[5:18], q[18:27], q[27:33], q[33:43]
    d = interp.offsets.as_dict()
    d.update(
        runtime_interpreters_head=rt[2],
        interp_next=it[2],
        interp_threads_head=it[3],
        tstate_next=ts[2],
        tstate_interp=ts[3],
        tstate_frame=ts[4],
        tstate_thread_id=ts[5],
        tstate_native_thread_id=ts[6],
        frame_back=fr[1],
        frame_code=fr[2],
        frame_owner=fr[5],
        code_filename=co[1],
        code_name=co[2],
        code_qualname=co[3],
        code_firstlineno=co[5],
    )
    interp.offsets = Offsets(**d)
    interp.debug_offsets = True


# ---- threads -------------------------------------------------------------------------------------


def ns_ids(status_path: str) -> List[int]:
    """The NSpid line of a /proc/PID[/task/TID]/status: the id in this /proc's PID namespace, then in
    each nested one down to the process's own (a container's); [] when unreadable."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


@dataclass
class ThreadReader:
    """tid -> PyThreadState* of every thread of the interpreter (re-read on demand).

    The tids are this /proc's (the host's, what BPF sees): the interpreter stores the ids of its
    own PID namespace, which in a container are not the host's, so they are translated."""

    interp: Interpreter
    pthread_tid_off: Optional[int] = None
    nested: Optional[bool] = None  # the process is in a PID namespace below this /proc's
    ns_tid: Dict[int, int] = field(default_factory=dict)  # host tid -> tid in the process's namespace

    def threads(self) -> Dict[int, int]:
        own = self._own_threads()
        if not self._nested():
            return own
        host = {ns: tid for tid, ns in self._tids().items()}  # listed after the read: none missed
        return {host[ns]: ts for ns, ts in own.items() if ns in host}

    def _nested(self) -> bool:
        if self.nested is None:
            ids = ns_ids(f"/proc/{self.interp.pid}/status")
            if not ids:  # unreadable (gone): ask again next time
                return False
            self.nested = len(ids) > 1
        return self.nested

    def _tids(self) -> Dict[int, int]:
        """host tid -> tid in the process's own PID namespace, of every live thread (NSpid read
        once per thread)."""
        pid = self.interp.pid
        try:
            live = {int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()}
        except OSError:
            return {}
        if not self._nested():
            return {t: t for t in live}
        for tid in [t for t in self.ns_tid if t not in live]:  # a host tid may come back as another thread
            del self.ns_tid[tid]
        for tid in live - self.ns_tid.keys():
            ids = ns_ids(f"/proc/{pid}/task/{tid}/status")
            if ids:
                self.ns_tid[tid] = ids[-1]
        return dict(self.ns_tid)

    def _own_threads(self) -> Dict[int, int]:
        """tid in the process's own namespace -> thread state, as the interpreter lists them."""
        o = self.interp.offsets
        mem = Mem(self.interp.pid)
        out: Dict[int, int] = {}
        try:
            interp_addr = mem.u64(self.interp.runtime + o.runtime_interpreters_head)
            seen = 0
            while interp_addr and seen < 16:
                seen += 1
                ts = mem.u64(interp_addr + o.interp_threads_head)
                n = 0
                while ts and n < 4096:
                    n += 1
                    tid = self._tid(mem, ts)
                    if tid:
                        out[tid] = ts
                    ts = mem.u64(ts + o.tstate_next)
                interp_addr = mem.u64(interp_addr + o.interp_next)
        finally:
            mem.close()
        return out

    def _tid(self, mem: Mem, tstate: int) -> Optional[int]:
        o = self.interp.offsets
        if o.tstate_native_thread_id != NONE:
            v = mem.u64(tstate + o.tstate_native_thread_id)
            return v if v and v < 1 << 31 else None
        # 3.9/3.10: thread_id is pthread_self(); glibc keeps the kernel tid inside struct pthread
        pt = mem.u64(tstate + o.tstate_thread_id)
        if not pt:
            return None
        if self.pthread_tid_off is None:
            self.pthread_tid_off = self._find_tid_offset(mem, pt)
        if self.pthread_tid_off is None:
            return None
        tid = mem.i32(pt + self.pthread_tid_off)
        return tid if tid and tid > 0 else None

    def _find_tid_offset(self, mem: Mem, pthread: int) -> Optional[int]:
        """The offset of `tid` in glibc's struct pthread: where a live thread id of the process is
        (as the process knows it: in its own PID namespace)."""
        tids = set(self._tids().values())
        if not tids:
            return None
        v = mem.i32(pthread + GLIBC_PTHREAD_TID)
        if v in tids:
            return GLIBC_PTHREAD_TID
        raw = mem.read(pthread, 0x1000)
        if raw is None:
            return None
        for off in range(0, len(raw) - 4, 4):
            if struct.unpack_from("<i", raw, off)[0] in tids:
                return off
        return None


# ---- code objects ---------------------------------------------------------------------------------


@dataclass
class CodeResolver:
    """Code object address -> Frame, cached (code objects of a training loop live as long as it)."""

    interp: Interpreter
    cache: Dict[int, Frame] = field(default_factory=dict)
    code_type: Optional[int] = None
    _ast: Dict[str, Dict[Tuple[int, str], str]] = field(default_factory=dict)

    def resolve(self, addrs: List[int]) -> List[Frame]:
        missing = [a for a in addrs if a not in self.cache]
        if missing:
            mem = Mem(self.interp.pid)
            try:
                for a in missing:
                    self.cache[a] = self._read(mem, a)
            finally:
                mem.close()
        return [self.cache[a] for a in addrs]

    def _read(self, mem: Mem, addr: int) -> Frame:
        o = self.interp.offsets
        typ = mem.u64(addr + o.object_type)
        if typ is None:
            return Frame("<unreadable>", "", 0)
        if typ != self.code_type:
            name_ptr = mem.u64(typ + o.type_name)
            if name_ptr is None or mem.cstr(name_ptr, 16) != "code":
                return Frame("<not code>", "", 0)
            self.code_type = typ
        name_off = o.code_qualname if o.code_qualname != NONE else o.code_name
        name = self._str(mem, mem.u64(addr + name_off)) or "?"
        filename = self._str(mem, mem.u64(addr + o.code_filename)) or ""
        line = mem.i32(addr + o.code_firstlineno) or 0
        if o.code_qualname == NONE:
            name = self._qualname(filename, line, name)
        return Frame(name, filename, line)

    def _str(self, mem: Mem, addr: Optional[int]) -> Optional[str]:
        """A str object's text (compact strings: every identifier and file name)."""
        if not addr:
            return None
        o = self.interp.offsets
        head = mem.read(addr + 16, 24)  # length, hash, state
        if head is None:
            return None
        length = struct.unpack_from("<q", head, 0)[0]
        state = head[o.unicode_state - 16]
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or not 0 <= length <= 4096 or kind not in (1, 2, 4):
            return None
        data = mem.read(addr + (o.unicode_ascii_data if ascii_ else o.unicode_compact_data), length * kind)
        if data is None:
            return None
        codec = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
        return data.decode(codec, errors="replace")

    def _qualname(self, filename: str, line: int, name: str) -> str:
        """3.9/3.10 code objects have no qualname: rebuild it from the source file's syntax tree."""
        table = self._ast.get(filename)
        if table is None:
            table = self._ast[filename] = qualnames_of(self._source(filename))
        return table.get((line, name), name)

    def _source(self, filename: str) -> str:
        for path in (f"/proc/{self.interp.pid}/root{filename}", filename):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    return f.read()
            except OSError:
                continue
        return ""


def qualnames_of(source: str) -> Dict[Tuple[int, str], str]:
    """(first line, name) -> qualname for every function and class body in `source`. The first line
    of a decorated function's code object is its first decorator's line; both are keyed."""
    out: Dict[Tuple[int, str], str] = {}
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return out

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = f"{prefix}{child.name}"
                lines = {child.lineno, *(d.lineno for d in child.decorator_list)}
                for ln in lines:
                    out[(ln, child.name)] = q
                inner = f"{q}.<locals>." if not isinstance(child, ast.ClassDef) else f"{q}."
                visit(child, inner)
            elif isinstance(child, ast.Lambda):
                out.setdefault((child.lineno, "<lambda>"), f"{prefix}<lambda>")
                visit(child, f"{prefix}<lambda>.<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out
