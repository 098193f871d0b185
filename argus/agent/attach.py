"""Which processes we can probe, and putting the probes in: per library file, per --step-fn, and
the launch probes in and out of their windows.

Uprobes are attached once per library file (by inode): the ranks of a job map the same file and
a `targets` map filters by tgid in BPF, so adding a process never attaches (or compiles) again.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from argus.agent import bpfprog
from argus.agent.keeper import Keeper, close_fds
from argus.agent.launchwin import ATTACH, DETACH, LaunchWindows
from argus.errors import EnvironmentProblem, NotATarget, SymbolMissing
from argus.probes import cpython, libcuda, libcudart, libnccl
from argus.probes.base import Channel, LibraryProbes, MappedLibrary, confirm_stubs, find_library, resolve
from argus.probes.elf import Elf

if TYPE_CHECKING:  # the session owns the health record; only its type is needed here
    from argus.agent.session import Health

AUX_CHANNELS = ("python", "host")  # no uprobe specs of their own: argus/agent/pyagent.py
ALL_CHANNELS: Tuple[Channel, ...] = (libcuda.CHANNEL, libcudart.CHANNEL, libnccl.CHANNEL)
DETECT: Dict[str, Callable[[int], Optional[MappedLibrary]]] = {
    "cuda": libcuda.detect,
    "cudart": libcudart.detect,
    "nccl": libnccl.detect,
}
STEP_FN_KEY = ("step", (0, 0))  # --step-fn is attached once, like a library file


@dataclass
class SlowProbe:
    library: str
    symbol: str
    insn: str
    note: str


def inspect(pid: int, channels: Sequence[Channel] = ALL_CHANNELS) -> Dict[str, LibraryProbes]:
    """Which channels apply to `pid`, resolved; raises when none, or when a required symbol is missing."""
    found: Dict[str, LibraryProbes] = {}
    for ch in channels:
        if ch.name in AUX_CHANNELS:
            continue
        lib = DETECT[ch.name](pid)
        if lib is not None:
            found[ch.name] = resolve(ch, lib)
    # a supported Python process is a target of the Python channel even without CUDA;
    # an unsupported one raises Unsupported here, before anything is compiled
    python = any(ch.name == "python" for ch in channels) and cpython.inspect(pid) is not None
    if not found and not python:
        raise NotATarget(
            f"pid {pid} maps no libcuda, libcudart or libnccl and is not a Python process: nothing to probe",
            f"check: grep -E 'libcuda|libnccl|python' /proc/{pid}/maps; "
            "`--all` waits for processes to appear",
        )
    for lp in found.values():
        if lp.missing_required:
            raise SymbolMissing(
                f"pid {pid}: {lp.library.path} lacks required symbol(s) {', '.join(lp.missing_required)}",
                f"this {lp.channel.name} version is not supported yet; --no-{lp.channel.name} skips it",
            )
    return found


def image_of(pid: int, libs: Dict[str, LibraryProbes]) -> Tuple[Tuple[str, int], ...]:
    """(path, start) of the first mapping of each probed library and of the vdso; () if unreadable.
    An exec moves them: the session compares it to tell a new program in the same pid."""
    want = {lp.library.path for lp in libs.values()} | {"[vdso]"}
    seen: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path in want and path not in seen:
                    seen[path] = int(parts[0].split("-")[0], 16)
    except OSError:
        return ()
    return tuple(sorted(seen.items()))


class Attacher:
    """The uprobes of one session: where each library file's probes went, and the launch probes'
    windows (argus/agent/launchwin.py decides when; this attaches and detaches)."""

    def __init__(
        self,
        bpf: Any,
        opts: bpfprog.BpfOptions,
        keeper: Keeper,
        health: Health,
        launch_window: Optional[Tuple[int, int]] = None,
    ) -> None:
        self.bpf, self.opts, self.keeper, self.health = bpf, opts, keeper, health
        # launch probes in windows of whole steps (argus/agent/launchwin.py); None: always attached
        self.windows = LaunchWindows(*launch_window) if launch_window else None
        self._launch_sites: List[Tuple[str, int, str]] = []  # (library path, address, symbol)
        self._launch_fds: Dict[str, int] = {}  # bcc event name -> perf fd, while a window is open
        self._attached: Set[Tuple[str, Tuple[int, int]]] = set()  # (channel, library inode)
        # per library file: symbol -> (file, address) its probes went to
        self._sites: Dict[Tuple[str, Tuple[int, int]], Dict[str, Tuple[str, int]]] = {}

    def library(self, pid: int, lp: LibraryProbes) -> None:
        """Probe a library `pid` maps (nothing to do when another process's probes are on its file)."""
        self._confirm_stubs(pid, lp)
        self._attach(lp)
        for name in lp.missing_optional:
            self.health.warnings.append(f"{lp.library.path}: optional symbol {name} missing (not probed)")

    def _confirm_stubs(self, pid: int, lp: LibraryProbes) -> None:
        """Probe what `pid` really calls behind each dispatch stub (argus/probes/trampoline.py). The
        first process of a library decides where its probes go; a later one that calls elsewhere is
        said, since uprobes are per file and the library's are already placed."""
        notes = confirm_stubs(pid, lp)
        placed = self._sites.get((lp.channel.name, lp.library.inode))
        if placed is None:
            self.health.warnings.extend(notes)
            return
        for p in lp.probes:
            if not p.duplicate and placed.get(p.spec.symbol, (p.path, p.address)) != (p.path, p.address):
                self.health.warnings.append(
                    f"pid {pid}: {os.path.basename(lp.library.path)}:{p.spec.symbol} dispatches elsewhere "
                    "than in the processes probed first: its calls there are not counted"
                )

    def _attach(self, lp: LibraryProbes) -> None:
        ident = (lp.channel.name, lp.library.inode)
        if ident in self._attached:
            return
        no_return = libcuda.entry_only(self.opts.launch_returns, self.opts.record) | libnccl.ENTRY_ONLY
        windowed = self.windows is not None and lp.channel.name == "cuda"
        self._sites[ident] = {p.spec.symbol: (p.path, p.address) for p in lp.probes}
        behind = [p for p in lp.probes if p.stub is not None and not p.duplicate]
        if any(p.stub is not None for p in lp.probes):
            self.health.stubs[os.path.basename(lp.library.path)] = (
                len(behind),
                sum(1 for p in lp.probes if not p.duplicate),
                sum(1 for p in behind if not p.plan.fast),
            )
        for p in lp.probes:
            if p.duplicate:  # its implementation is probed under another name of the same call
                continue
            path = p.path or lp.library.host_path
            addr = p.address
            prog = p.spec.prog
            try:
                if windowed and prog in libcuda.LAUNCH_CALLS:  # attached by poll_windows
                    site = (path, addr, prog)
                    self._launch_sites.append(site)
                    if self.windows is not None and self.windows.is_open():
                        self._attach_launch(site)
                    self.health.attached += 1 + int(self.opts.launch_returns)
                else:
                    if p.spec.entry:
                        self.bpf.attach_uprobe(name=path, addr=addr, fn_name=f"{prog}_entry")
                        self.health.attached += 1
                    if p.spec.ret and prog not in no_return:
                        self.bpf.attach_uretprobe(name=path, addr=addr, fn_name=f"{prog}_return")
                        self.health.attached += 1
            except Exception as e:  # bcc raises a bare Exception; the kernel's reason is on stderr
                raise EnvironmentProblem(
                    f"cannot attach a uprobe to {p.spec.symbol} in {path} at {addr:#x}: {e}",
                    "another tracer (a bcc tool with Debian's ref_ctr_offset bug, see docs/probe.md) may "
                    "hold a uprobe at the same address: stop it and retry; or the library file was "
                    "replaced since the process loaded it (restart the process to probe it)",
                ) from None
            if not p.plan.fast:
                self.health.slow_probes.append(
                    SlowProbe(os.path.basename(path), p.spec.symbol, p.plan.insn, p.plan.note)
                )
        self._attached.add(ident)

    def step_fn(self, pid: int, step_fn: str) -> None:
        """--step-fn [LIB:]SYMBOL: every call ends a step (a native function of the process; attached
        for the first process, like a library's probes)."""
        if STEP_FN_KEY in self._attached:
            return
        lib, _, sym = step_fn.rpartition(":")
        mapped = find_library(pid, lib) if lib else None
        path = mapped.host_path if mapped else f"/proc/{pid}/exe"
        elf = Elf(path)
        s = elf.symbols.get(sym)
        if s is None:
            raise SymbolMissing(
                f"--step-fn: {sym} not found in {path}",
                "give LIBRARY_REGEX:SYMBOL, e.g. 'libtrain\\.so:train_step'",
            )
        self.bpf.attach_uprobe(name=path, addr=s.vaddr, fn_name="step_marker_entry")
        self._attached.add(STEP_FN_KEY)

    # ---- launch windows ------------------------------------------------------------------------------

    def _attach_launch(self, site: Tuple[str, int, str]) -> None:
        path, addr, sym = site
        before = set(self.bpf.uprobe_fds)
        self.bpf.attach_uprobe(name=path, addr=addr, fn_name=f"{sym}_entry")
        if self.opts.launch_returns:
            self.bpf.attach_uretprobe(name=path, addr=addr, fn_name=f"{sym}_return")
        for k in set(self.bpf.uprobe_fds) - before:
            self._launch_fds[k] = self.bpf.uprobe_fds[k]

    def poll_windows(self) -> None:
        """Attach or detach the launch probes when their window says so (cheap: call it often)."""
        if self.windows is None:
            return
        what = self.windows.tick(time.monotonic_ns())
        if what == ATTACH:
            try:
                for site in self._launch_sites:
                    self._attach_launch(site)
            except Exception as e:  # bcc raises a bare Exception: keep tracing without launches
                self.health.warnings.append(f"kernel launches are no longer probed: attaching failed ({e})")
                self._launch_sites.clear()
            self.keeper.sync(self.bpf.uprobe_fds)
            self.windows.opened(time.monotonic_ns())
        elif what == DETACH:
            self.windows.closed(time.monotonic_ns())
            held = self.keeper.holds_all(
                {k: v for k, v in self.bpf.uprobe_fds.items() if k in self._launch_fds}
            )
            fds = [self.bpf.uprobe_fds.pop(k) for k in self._launch_fds if k in self.bpf.uprobe_fds]
            self._launch_fds.clear()
            if held:  # not the last reference: closing ours is cheap, the keeper's close removes them
                close_fds(fds)
                self.keeper.sync(self.bpf.uprobe_fds)
            else:  # each removal waits for an RCU grace period (~0.1 s): not on the loop's time
                threading.Thread(target=close_fds, args=(fds,), name="argus-detach", daemon=True).start()
