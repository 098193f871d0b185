"""Declarative uprobe specs, the table of probed calls, and finding libraries in a process.

Each probe target module (libcuda, libnccl, ...) exports its specs as frozen data and a
`detect(pid)` returning the mapped library or None. Call ids are assigned here, once, and handed
to the BPF programs as -D flags, so C and Python never disagree on what call 7 is. The same table
says each call's channel and class, so the agent tells calls apart by what they are, never by how
their names start.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from argus.errors import NoSuchProcess, PermissionDenied
from argus.probes import trampoline
from argus.probes.elf import Elf, ElfError
from argus.probes.prologue import EntryPlan, plan_entry
from argus.probes.trampoline import Stub, find_stub

# What kind of call a probed call is (UprobeSpec.cls): what the agent does with its records and counts.
LAUNCH = "launch"  # enqueues one kernel (cuLaunchKernel, cuLaunchKernelEx)
GRAPH_LAUNCH = "graph_launch"  # enqueues a CUDA graph: many kernels for one call, keyed by the graph
SYNC = "sync"  # the host waits for the GPU: closes an epoch (argus/bpf/cuda.bpf.c SYNC_PROBE)
ENQUEUE = "enqueue"  # stream-ordered, the host does not wait: async copies, memsets, allocations
EVENT_RECORD = "event_record"
COLLECTIVE = "collective"  # an NCCL collective: every rank of the communicator calls it, in order
P2P = "p2p"  # ncclSend/ncclRecv: between two ranks, not numbered across the communicator
GROUP = "group"  # ncclGroupStart/ncclGroupEnd
COMM_INIT = "comm_init"  # creates a communicator
NET_SEND = "net_send"  # a network transport's send, on NCCL's proxy thread
MARKER = "marker"  # --step-fn: the user's step function
CALL = "call"  # anything else: counted, its errors too


@dataclass(frozen=True)
class UprobeSpec:
    symbol: str
    entry: bool = True  # attach <prog>_entry
    ret: bool = True  # attach <prog>_return
    required: bool = False
    handler: str = ""  # the call whose BPF programs and call id this symbol shares (a `_ptsz` variant)
    report_missing: bool = True  # False: many builds lack it (variants, newer calls): absent is normal
    cls: str = CALL  # what kind of call (LAUNCH, SYNC, ...): the call table's class of its call id

    @property
    def prog(self) -> str:
        """The call this symbol is counted as: its BPF programs are <prog>_entry/<prog>_return."""
        return self.handler or self.symbol


@dataclass(frozen=True)
class Channel:
    """A probe target: which library, which calls, which BPF source."""

    name: str  # "cuda", "nccl"
    library_re: str  # matched against the basename of mapped files
    source: str  # argus/bpf/<source>
    specs: Tuple[UprobeSpec, ...]
    macro: str  # -D switch that includes the channel

    def spec(self, symbol: str) -> UprobeSpec:
        return next(s for s in self.specs if s.symbol == symbol)


@dataclass
class MappedLibrary:
    path: str  # as the process sees it (may be under /proc/PID/root for containers)
    host_path: str  # openable from the agent
    inode: Tuple[int, int]


@dataclass
class ResolvedProbe:
    spec: UprobeSpec
    vaddr: int  # the symbol's ELF virtual address (bcc translates it to the file offset)
    plan: EntryPlan  # where to attach in the function probed (the stub's target when `stub` is set)
    stub: Optional[Stub] = None  # the symbol is a dispatch stub: its implementation is probed
    path: str = ""  # the file probed when not the library itself (a replaced slot's target)
    duplicate: bool = False  # another symbol of the same call reaches the same implementation: probed once

    @property
    def target(self) -> int:
        """ELF vaddr of the function probed: the implementation behind a stub, else the symbol."""
        return self.stub.target if self.stub is not None and self.stub.target is not None else self.vaddr

    @property
    def address(self) -> int:
        return self.target + self.plan.offset


@dataclass
class LibraryProbes:
    channel: Channel
    library: MappedLibrary
    probes: List[ResolvedProbe] = field(default_factory=list)
    missing_optional: List[str] = field(default_factory=list)
    missing_required: List[str] = field(default_factory=list)
    elf: Optional[Elf] = None


# Every call any channel probes, in a fixed order: the index is the call id in records and maps.
ALL_CALLS: List[str] = []
# per call id (index id - 1): the channel that probes it ("cuda", "cudart", "nccl", "step") and its
# class; read where summaries are cut (per step, per record where a record needs it: a list index)
CALL_CHANNELS: List[str] = []
CALL_CLASSES: List[str] = []
_IDS: Dict[str, int] = {}


def register_calls(names: Sequence[str], channel: str = "", cls: str = CALL) -> None:
    """Give each call an id, once; a registration that names the channel completes a bare one."""
    for n in names:
        i = _IDS.get(n)
        if i is None:
            ALL_CALLS.append(n)
            CALL_CHANNELS.append(channel)
            CALL_CLASSES.append(cls)
            _IDS[n] = len(ALL_CALLS)
        elif channel and not CALL_CHANNELS[i - 1]:
            CALL_CHANNELS[i - 1], CALL_CLASSES[i - 1] = channel, cls


def register_channel(channel: Channel) -> None:
    """Every call of a channel's specs, with its class; a variant (`handler`) shares its call's id."""
    for s in channel.specs:
        if not s.handler:
            register_calls([s.symbol], channel.name, s.cls)


def call_id(name: str) -> int:
    i = _IDS.get(name)
    if i is None:
        raise ValueError(f"{name!r} is not a probed call")
    return i


def call_name(cid: int) -> str:
    return ALL_CALLS[cid - 1] if 0 < cid <= len(ALL_CALLS) else f"call#{cid}"


def call_channel(cid: int) -> str:
    """The channel of a call id ("" for an id no channel registered)."""
    return CALL_CHANNELS[cid - 1] if 0 < cid <= len(CALL_CHANNELS) else ""


def call_class(cid: int) -> str:
    return CALL_CLASSES[cid - 1] if 0 < cid <= len(CALL_CLASSES) else CALL


def calls_of(channel: str = "", cls: str = "") -> frozenset:
    """Names of the registered calls of a channel and/or class."""
    return frozenset(
        n
        for n, ch, c in zip(ALL_CALLS, CALL_CHANNELS, CALL_CLASSES)
        if (not channel or ch == channel) and (not cls or c == cls)
    )


def call_cflags() -> List[str]:
    return [f"-DCALL_{n}={i + 1}" for i, n in enumerate(ALL_CALLS)]


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        raise NoSuchProcess(
            f"no process with pid {pid}", "check the pid: ps -eo pid,cmd | grep train"
        ) from None
    except PermissionError:
        raise PermissionDenied(
            f"cannot read /proc/{pid}/maps", "run as root: sudo argus probe -p PID"
        ) from None


def host_path(pid: int, path: str) -> str:
    """Where the agent opens a file the process maps: through its root (the process may live in
    another mount namespace), else as named."""
    host = f"/proc/{pid}/root{path}"
    return host if os.path.exists(host) else path


def find_library(pid: int, pattern: str) -> Optional[MappedLibrary]:
    """The first mapped file of `pid` whose basename matches `pattern` (regex, full match)."""
    rx = re.compile(pattern)
    for line in _maps(pid).splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)") or not rx.fullmatch(os.path.basename(path)):
            continue
        host = host_path(pid, path)
        try:
            st = os.stat(host)
        except OSError:
            continue
        # the plain path where it names the very file (a host process); else the file as the process
        # sees it, through /proc/PID/root (a container whose image ships its own copy at that path)
        real = os.path.realpath(host)
        try:
            r = os.stat(real)
            same = (r.st_dev, r.st_ino) == (st.st_dev, st.st_ino)
        except OSError:
            same = False
        return MappedLibrary(path, real if same else host, (st.st_dev, st.st_ino))
    return None


#: resolved once per library file: the ranks of a job map the same file, and choosing attach points
#: disassembles prologues with objdump (~20 runs, 150 ms per process: ranks went live 8 steps apart)
_RESOLVED: Dict[Tuple[str, Tuple[int, int], int], LibraryProbes] = {}


def resolve(channel: Channel, lib: MappedLibrary) -> LibraryProbes:
    """Find each spec's symbol and choose its attach point; classify what is missing."""
    try:
        key = (channel.name, lib.inode, os.stat(lib.host_path).st_mtime_ns)
    except OSError:
        return _resolve(channel, lib)
    hit = _RESOLVED.get(key)
    if hit is None:
        hit = _RESOLVED[key] = _resolve(channel, lib)
    return dataclasses.replace(
        hit,
        library=lib,
        probes=list(hit.probes),
        missing_optional=list(hit.missing_optional),
        missing_required=list(hit.missing_required),
    )


def _resolve(channel: Channel, lib: MappedLibrary) -> LibraryProbes:
    out = LibraryProbes(channel, lib)
    try:
        elf = Elf(lib.host_path)
    except (OSError, ElfError) as e:
        out.missing_required = [f"(unreadable: {e})"]
        return out
    out.elf = elf
    owner: Dict[int, str] = {}  # implementation vaddr -> the call probed there
    for spec in channel.specs:
        sym = elf.symbols.get(spec.symbol)
        if sym is None:
            if spec.required:
                out.missing_required.append(spec.symbol)
            elif spec.report_missing:
                out.missing_optional.append(spec.symbol)
            continue
        code = elf.read(sym.offset, 48)
        stub = find_stub(elf, sym.vaddr, code)
        if stub is not None and stub.target is not None and owner.get(stub.target, spec.prog) == spec.prog:
            impl = elf.read(elf.vaddr_to_offset(stub.target), 48)
            plan = plan_entry(impl, lib.host_path, stub.target)
            if plan.fast or not plan_entry(code, lib.host_path, sym.vaddr).fast:
                dup = stub.target in owner
                owner[stub.target] = spec.prog
                out.probes.append(ResolvedProbe(spec, sym.vaddr, plan, stub, duplicate=dup))
                continue
        # an ordinary function, or a stub whose target another call already owns (two names for one
        # implementation cannot be told apart there: each keeps its own stub)
        out.probes.append(ResolvedProbe(spec, sym.vaddr, plan_entry(code, lib.host_path, sym.vaddr)))
    return out


def confirm_stubs(pid: int, lp: LibraryProbes) -> List[str]:
    """Check each probed stub's slot in `pid`'s memory against its relocation; where a tool replaced
    it, probe what the process really calls (a function in a mapped file), or the stub itself when
    the slot points into anonymous memory. Rewrites `lp.probes`; returns what it found, to say."""
    stubs = [(i, p) for i, p in enumerate(lp.probes) if p.stub is not None and not p.duplicate]
    if not stubs or lp.elf is None:
        return []
    try:
        maps = trampoline.mappings(pid)
    except OSError:
        return []
    bias = trampoline.load_bias(maps, lp.elf, lp.library.path)
    if bias is None:
        return []
    notes: List[str] = []
    name = os.path.basename(lp.library.path)
    for i, p in stubs:
        assert p.stub is not None
        live = trampoline.read_slot(pid, bias + p.stub.slot)
        if live is None:
            notes.append(
                f"{name}:{p.spec.symbol}: cannot read its dispatch slot in pid {pid}; probing the "
                "implementation its relocation names"
            )
            continue
        if p.stub.target is not None and live == bias + p.stub.target:
            continue
        where = trampoline.locate(maps, live, Elf)
        if where.path:
            host = host_path(pid, where.path)
            try:
                other = Elf(host)
                code = other.read(other.vaddr_to_offset(where.vaddr), 48)
            except (OSError, ElfError):
                code = b""
            if code:
                plan = plan_entry(code, host, where.vaddr)
                lp.probes[i] = dataclasses.replace(
                    p, stub=Stub(p.stub.slot, where.vaddr), plan=plan, path=host
                )
                notes.append(
                    f"{name}:{p.spec.symbol}: its dispatch slot was replaced in pid {pid}: probing what "
                    f"it calls, {os.path.basename(where.path)}+{where.vaddr:#x}"
                )
                continue
        sym = lp.elf.symbols.get(p.spec.symbol)
        code = lp.elf.read(sym.offset, 48) if sym is not None else b""
        lp.probes[i] = dataclasses.replace(p, stub=None, plan=plan_entry(code, lp.library.host_path, p.vaddr))
        notes.append(
            f"{name}:{p.spec.symbol}: its dispatch slot points into anonymous memory in pid {pid} "
            f"({live:#x}): probing the exported stub (single-stepped, ~13 µs a call)"
        )
    return notes
