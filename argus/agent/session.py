"""The probing session: load BPF, attach to libraries, register target processes, and turn ring
records and drained maps into per-step summaries.

One session serves many processes: uprobes are attached once per library file (by inode) and a
`targets` map filters by tgid, so adding a process never recompiles. The loop never blocks the
targets: BPF programs only count and append; all work happens here, on the agent's time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from argus.agent import bpfprog, clock, identity
from argus.agent.attachscan import AttachScans
from argus.agent.identity import Identity
from argus.agent.keeper import Keeper
from argus.agent.keeper import close_fds as _close_fds
from argus.agent.launchwin import ATTACH, DETACH, LaunchWindows
from argus.agent.tracker import RankTracker
from argus.errors import ArgusError, EnvironmentProblem, NotATarget, SymbolMissing
from argus.probes import cpython, libcuda, libcudart, libnccl
from argus.probes.base import Channel, LibraryProbes, MappedLibrary, confirm_stubs, resolve
from argus.probes.elf import Elf
from argus.probes.records import DROP_NAMES, DecodeError, TargetCfg, decode_at

AUX_CHANNELS = ("python", "host")  # no uprobe specs of their own: argus/agent/pyagent.py
ALL_CHANNELS: Tuple[Channel, ...] = (libcuda.CHANNEL, libcudart.CHANNEL, libnccl.CHANNEL)
DETECT: Dict[str, Callable[[int], Optional[MappedLibrary]]] = {
    "cuda": libcuda.detect,
    "cudart": libcudart.detect,
    "nccl": libnccl.detect,
}


@dataclass
class Target:
    pid: int
    identity: Identity
    tracker: RankTracker
    libraries: Dict[str, LibraryProbes]
    final_before: int = 0  # epochs below this are complete in the maps
    seen_epoch: int = 0  # the epoch counter at the previous drain
    alive: bool = True
    flushed: bool = False  # after exit: the tail was emitted
    layout: libnccl.CommLayout = libnccl.UNKNOWN_LAYOUT  # how its communicators are identified
    image: Tuple[Tuple[str, int], ...] = ()  # where its libraries and vdso sit: an exec moves them


@dataclass
class SlowProbe:
    library: str
    symbol: str
    insn: str
    note: str


@dataclass
class Health:
    drops: Dict[str, int] = field(default_factory=dict)
    decode_errors: int = 0
    attached: int = 0
    slow_probes: List[SlowProbe] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    # library -> (probes at the implementations behind dispatch stubs, probes, of those single-stepped)
    stubs: Dict[str, Tuple[int, int, int]] = field(default_factory=dict)
    # traced but in no step (argus.agent.tracker.RankTracker.left_out), summed over targets
    left_out: Counter = field(default_factory=Counter)


class Session:
    def __init__(
        self,
        channels: Sequence[Channel] = ALL_CHANNELS,
        opts: Optional[bpfprog.BpfOptions] = None,
        step_fn: Optional[str] = None,
        py_opts: Optional[Any] = None,
        launch_window: Optional[Tuple[int, int]] = None,
    ) -> None:
        self.channels = list(channels)
        self.opts = opts or bpfprog.BpfOptions()
        self.step_fn = step_fn
        # launch probes in windows of whole steps (argus/agent/launchwin.py); None: always attached
        self.windows = LaunchWindows(*launch_window) if launch_window else None
        self._launch_sites: List[Tuple[str, int, str]] = []  # (library path, address, symbol)
        self._launch_fds: Dict[str, int] = {}  # bcc event name -> perf fd, while a window is open
        self.targets: Dict[int, Target] = {}
        self.health = Health()
        self._attached_inodes: Set[Tuple[str, Tuple[int, int]]] = set()
        # per library file: symbol -> (file, address) its probes went to
        self._sites: Dict[Tuple[str, Tuple[int, int]], Dict[str, Tuple[str, int]]] = {}
        self._layouts: Dict[Tuple[int, int], libnccl.CommLayout] = {}
        self.scans = AttachScans()  # threads already blocked in a probed call when we attached
        self.last_record: Dict[int, Dict[int, int]] = {}  # pid -> tid -> ts of its latest ring record
        self._identity_changes: List[Tuple[Target, Identity]] = []
        self._added_at: Dict[int, float] = {}  # pid -> monotonic s of its first identity re-read
        self._reread_at: Dict[int, float] = {}  # pid -> its next identity re-read, after the first minute
        bpfprog.preflight()
        self.bpf: Any = bpfprog.load(self.channels, self.opts)
        # a copy of every uprobe's perf fd in a second process: the probes come out of the job
        # even when we are killed with SIGKILL (argus/agent/keeper.py)
        self.keeper = Keeper()
        if not self.keeper.start():
            self.health.warnings.append(
                f"{self.keeper.error}: a SIGKILL of the agent may leave probes behind"
            )
        self.bpf["records"].open_ring_buffer(self._on_ring)
        self.started_ns = time.monotonic_ns()
        self.py: Any = None  # the Python and host channels (argus/agent/pyagent.py)
        names = {c.name for c in self.channels}
        if names & set(AUX_CHANNELS):
            from argus.agent.pyagent import PyAgent, PyOptions

            po = dataclasses.replace(py_opts or PyOptions(), python="python" in names, host="host" in names)
            self.py = PyAgent(self.bpf, po, self.health.warnings.append)

    # ---- targets -------------------------------------------------------------------------------------

    def add(self, pid: int, identity: Identity) -> Target:
        libs = inspect(pid, self.channels)
        layout = libnccl.UNKNOWN_LAYOUT
        nccl = libs.get("nccl")
        if nccl is not None and nccl.elf is not None:
            layout = self._layouts.get(nccl.library.inode) or libnccl.layout_of(nccl.elf)
            self._layouts[nccl.library.inode] = layout  # decoded once per library file
        for lp in libs.values():
            self._confirm_stubs(pid, lp)
            self._attach(lp)
            for name in lp.missing_optional:
                self.health.warnings.append(f"{lp.library.path}: optional symbol {name} missing (not probed)")
        self._attach_step_fn(pid)
        tracker = RankTracker(
            identity,
            layout,
            read_mem=functools.partial(read_process, pid),
            step_fn=self.step_fn is not None,
        )
        t = Target(pid, identity, tracker, libs, layout=layout, image=image_of(pid, libs))
        if self.py is not None:
            self.py.add(pid, tracker.sections)
        # start counting epochs from where the process is (0 when new)
        key = ctypes.c_uint32(pid)
        epochs = self.bpf["epochs"]
        cur = epochs.get(key)
        if cur is None:
            epochs[key] = ctypes.c_uint64(0)
        else:
            t.seen_epoch = t.final_before = t.tracker.next_epoch = int(cur.value)
        cfg = TargetCfg(
            rank=max(identity.rank, 0) & 0xFFFFFFFF,
            flags=0,
            off_comm_hash=layout.comm_hash,
            off_comm_rank=layout.rank,
            off_comm_nranks=layout.nranks,
        )
        tbl = self.bpf["targets"]
        tbl[key] = tbl.Leaf.from_buffer_copy(bytes(cfg))
        self.targets[pid] = t
        self.keeper.sync(self.bpf.uprobe_fds)
        # after the probes are live: a thread found inside a probed call now entered it before
        self.scans.scan(pid, list(libs.values()), self._interpreter(pid), is_comm=tracker.is_comm)
        return t

    def _interpreter(self, pid: int) -> Optional[cpython.Interpreter]:
        pt = self.py.targets.get(pid) if self.py is not None else None
        if pt is not None:
            return pt.interp
        try:
            return cpython.inspect(pid)
        except ArgusError:  # an unsupported Python: native frames only
            return None

    def where(self, pid: int) -> str:
        """What the process is doing now, from its threads (for a hang: the ranks not blocked)."""
        t = self.targets.get(pid)
        if t is None or not t.alive:
            return ""
        return self.scans.where(pid, list(t.libraries.values()), self._interpreter(pid))

    def remove(self, pid: int) -> None:
        t = self.targets.get(pid)
        if t is None:
            return
        t.alive = False
        try:
            del self.bpf["targets"][ctypes.c_uint32(pid)]
        except KeyError:
            pass
        if self.py is not None:
            self.py.remove(pid)
        self.scans.forget(pid)
        self.last_record.pop(pid, None)
        self._added_at.pop(pid, None)
        self._reread_at.pop(pid, None)

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
        if ident in self._attached_inodes:
            return
        no_return = libcuda.entry_only(self.opts.launch_returns) | libnccl.ENTRY_ONLY
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
        self._attached_inodes.add(ident)

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
                _close_fds(fds)
                self.keeper.sync(self.bpf.uprobe_fds)
            else:  # each removal waits for an RCU grace period (~0.1 s): not on the loop's time
                threading.Thread(target=_close_fds, args=(fds,), name="argus-detach", daemon=True).start()

    def _mark_unsampled(self, d: dict) -> None:
        """Launch data of a step the launch probes did not cover whole: dropped, and said so."""
        cu = d.get("cuda")
        if cu is not None and "launches" in cu:
            cu["launches"] = {"total": 0, "by_kernel": {}, "api_ns_log2_hist": {}, "sampled": False}
        py = d.get("python")
        if py is not None:
            py.pop("gpu_phases", None)  # timers are labelled by the walks at launches
            for calls in py.get("calls", {}).values():
                calls.pop("launches", None)

    def _attach_step_fn(self, pid: int) -> None:
        """--step-fn [LIB:]SYMBOL: every call ends a step (a native function of the process)."""
        if not self.step_fn or ("step", 0) in {(a, 0) for a, _ in self._attached_inodes}:
            return
        lib, _, sym = self.step_fn.rpartition(":")
        from argus.probes.base import find_library

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
        self._attached_inodes.add(("step", (0, 0)))

    # ---- the loop ------------------------------------------------------------------------------------

    def _on_ring(self, _ctx: Any, data: Any, size: int) -> int:
        # an int, always: bcc's wrapper calls int() on what this returns and catches the TypeError
        # of None, which cost more than decoding the record (per record, tens of thousands a second)
        try:
            rec = decode_at(data, size)
        except DecodeError:
            self.health.decode_errors += 1
            return 0
        self._on_record(rec)
        return 0

    def _on_record(self, rec: Any) -> None:
        if self.py is not None and self.py.on_record(rec):
            return
        seen = self.last_record.get(rec.h.tgid)
        if seen is None:
            seen = self.last_record[rec.h.tgid] = {}
        seen[rec.h.tid] = rec.h.ts
        t = self.targets.get(rec.h.tgid)
        if t is not None:
            t.tracker.on_record(rec)

    def consume(self) -> None:
        self.bpf.ring_buffer_consume()

    def drain(self) -> None:
        """Read the aggregation maps into the trackers; delete entries of complete epochs."""
        cur = {int(k.value): int(v.value) for k, v in self.bpf["epochs"].items()}
        final: Dict[int, int] = {}
        for pid, t in self.targets.items():
            # epochs closed before the previous drain get no more updates: they are final now
            final[pid] = min(t.seen_epoch, cur.get(pid, 0)) if t.alive else cur.get(pid, 0) + 1
            t.seen_epoch = cur.get(pid, 0)

        def take(table: str, on: Callable[[Target, Any, Any], None]) -> None:
            tbl = self.bpf[table]
            done = []
            for k, v in tbl.items():
                t = self.targets.get(k.tgid)
                if t is None:
                    done.append(k)  # a process we no longer track
                    continue
                if k.epoch < final[k.tgid] and k.epoch >= t.final_before:
                    on(t, k, v)
                    done.append(k)
                elif k.epoch < t.final_before:
                    done.append(k)
            for k in done:
                try:
                    del tbl[k]
                except KeyError:
                    pass

        if "cuda" in {c.name for c in self.channels}:
            take("launches", lambda t, k, v: t.tracker.add_launches(k.epoch, k.func, v.value))
            take("hists", lambda t, k, v: t.tracker.add_hist(k.epoch, k.slot, v.value))
            take("mem", lambda t, k, v: t.tracker.add_mem(k.epoch, k.kind, v.count, v.bytes))
        take("errors", lambda t, k, v: t.tracker.add_error(k.epoch, k.call, k.result, v.value))
        take("call_counts", lambda t, k, v: t.tracker.add_call(k.epoch, k.call, v.value))
        if self.py is not None:
            self.py.drain(final, {pid: t.final_before for pid, t in self.targets.items()})
        for pid, t in self.targets.items():
            t.final_before = max(t.final_before, final[pid])
        for i, name in DROP_NAMES.items():
            v = int(self.bpf["drops"][ctypes.c_int(i)].value)
            if v:
                self.health.drops[name] = v
        gone: List[Any] = []
        for k, v in self.bpf["drops_by_pid"].items():  # a handful of entries: only where records were lost
            lost = self.targets.get(k.tgid)
            if lost is None:
                gone.append(k)
            elif k.slot in DROP_NAMES:
                lost.tracker.drops_total[DROP_NAMES[k.slot]] = int(v.value)
        for k in gone:
            try:
                del self.bpf["drops_by_pid"][k]
            except KeyError:
                pass

    def _learn_identities(self) -> None:
        """A target without a rank from its environment takes it from the largest NCCL
        communicator it uses, once the tracker has read one (argus/agent/identity.py)."""
        for t in self.targets.values():
            w = t.tracker.world_communicator()
            new = t.identity.with_communicator(w.nranks, w.rank) if w is not None else None
            if new is not None:
                self._identity_changes.append((t, t.identity))
                t.identity = t.tracker.id = new

    def reread_identities(self, job: Optional[str], host: Optional[str]) -> None:
        """Targets still without a rank from their environment or a flag: read the live environment
        again (a spawned rank sets RANK after `import torch` mapped libnccl, so an early attach
        sees none yet). The job id follows, since no rank of it was known. Each call for the first
        minute of a target, then every 30 s (~1 ms a read)."""
        now = time.monotonic()
        for t in self.targets.values():
            if not t.alive or t.identity.rank_from in (identity.FLAG, identity.LIVE, identity.NCCL):
                continue
            added = self._added_at.setdefault(t.pid, now)
            if now - added > 60 and now < self._reread_at.get(t.pid, 0.0):
                continue
            self._reread_at[t.pid] = now + 30
            try:
                new = identity.of_pid(t.pid, job, None, host)
            except ArgusError:
                continue
            if new.rank_from == identity.LIVE:
                self._identity_changes.append((t, t.identity))
                t.identity = t.tracker.id = new

    def take_identity_changes(self) -> List[Tuple[Target, Identity]]:
        """(target, its identity before) for each target whose identity changed since the last call."""
        out, self._identity_changes = self._identity_changes, []
        return out

    def steps(self) -> List[dict]:
        """Complete steps of every target since the last call."""
        self._learn_identities()
        wall, err = clock.wall_offset()
        out: List[dict] = []
        for t in self.targets.values():
            out.extend(t.tracker.finalize(t.final_before, wall))
            self.health.left_out.update(t.tracker.take_left_out())
            if not t.alive and not t.flushed:
                t.flushed = True
                tail = t.tracker.flush_tail(wall)
                if tail is not None:
                    out.append(tail)
        for d in out:
            d["wall_offset_err_ns"] = err
        if self.windows is not None:
            for d in out:
                if "start_ns" in d and "end_ns" in d and self.windows.sampled(d["start_ns"], d["end_ns"]):
                    if "launches" in d.get("cuda", {}):
                        d["cuda"]["launches"]["sampled"] = True
                else:
                    self._mark_unsampled(d)
            self.windows.observe(d["duration_ns"] for d in out if d["step"] is not None)
            self.poll_windows()
        return out

    def inflight(self) -> List[dict]:
        """Calls entered and not returned (what a hung rank is blocked in)."""
        from argus.probes.base import call_channel, call_name

        now = time.monotonic_ns()
        out = []
        for k, v in self.bpf["inflight_calls"].items():
            if v.tgid in self.targets:
                out.append(
                    {
                        "pid": v.tgid,
                        "tid": int(k.value) >> 1,
                        "call": call_name(v.call),
                        "channel": call_channel(v.call),
                        "since_ns": v.enter_ns,
                        "age_s": (now - v.enter_ns) / 1e9,
                        "handle": v.handle,
                        "seq": v.seq,
                        "scan": False,
                    }
                )
        # entered before we attached, found by the attach scan (since: a lower bound)
        for pid, t in self.targets.items():
            if not t.alive:
                continue
            steps = t.tracker.steps_emitted
            libs = list(t.libraries.values())
            for b in self.scans.still_blocked(pid, self.last_record.get(pid, {}), steps, libs):
                out.append(
                    {
                        "pid": pid,
                        "tid": b.tid,
                        "call": b.call,
                        "channel": b.channel,
                        "since_ns": b.since_ns,
                        "age_s": (now - b.since_ns) / 1e9,
                        "handle": b.comm,
                        "seq": None,
                        "scan": True,
                    }
                )
        return out

    def execed(self) -> List[int]:
        """Live targets that ran exec since they were added: a new program in the same pid (its
        address space is new: the libraries and the vdso moved, or are gone)."""
        out = []
        for pid, t in self.targets.items():
            if t.alive and t.image and not process_gone(pid):
                now = image_of(pid, t.libraries)
                if now and now != t.image:
                    out.append(pid)
        return out

    def forget(self, pid: int) -> None:
        """Drop a removed target whose tail was flushed (the pid runs a new program, added anew)."""
        t = self.targets.get(pid)
        if t is not None and not t.alive and t.flushed:
            del self.targets[pid]

    def exited(self) -> List[int]:
        """Targets whose process is gone but that are still tracked (see `reap`)."""
        return [pid for pid, t in self.targets.items() if t.alive and process_gone(pid)]

    def reap(self, gone: List[int]) -> List[int]:
        """Stop tracking the exited targets `gone` (from `exited`); their remaining steps are flushed."""
        for pid in gone:
            self.remove(pid)
        return gone

    def close(self, background: bool = False) -> None:
        """Detach everything.

        Removing a uprobe waits for an RCU grace period under a global mutex: ~0.11 s each here,
        8 s for 72 probes. The keeper holds the last references and pays that (after we are gone,
        with `background`); without a keeper, a forked child does. The probes already do nothing
        (the targets map is cleared first).
        """
        if self.py is not None:
            self.py.close()  # USDT semaphores back to what they were
        try:
            self.bpf["targets"].clear()
        except Exception:  # the map may already be gone during shutdown
            pass
        if self.keeper.holds_all(self.bpf.uprobe_fds):
            # our copies are not the last: closing them is cheap; the keeper removes the probes
            _close_fds(list(self.bpf.uprobe_fds.values()))
            self.bpf.uprobe_fds.clear()
            self.keeper.release()
            if not background:
                self.keeper.wait()  # the probes are gone when we return
        elif background and self.bpf.uprobe_fds:
            self.keeper.release()  # the child below must not hold the keeper's socket open
            parent = os.getpid()
            if os.fork() == 0:  # child: outlive the parent, then exiting closes the perf fds (slowly)
                os.setsid()
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):  # let pipes to our caller close now
                    os.dup2(null, fd)
                deadline = time.monotonic() + 600
                while os.getppid() == parent and time.monotonic() < deadline:
                    time.sleep(0.05)
                os._exit(0)
            self.bpf.uprobe_fds.clear()  # our copies close cheaply at exit (the child still holds them)
        try:
            self.bpf.cleanup()
        except Exception:  # detaching during interpreter shutdown must not raise
            pass


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
    """(path, start) of the first mapping of each probed library and of the vdso; () if unreadable."""
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


def process_gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie waiting to be reaped."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :][:1] in ("Z", "X")


def read_process(pid: int, addr: int, n: int) -> Optional[bytes]:
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(addr)
            return f.read(n)
    except (OSError, ValueError, OverflowError):
        return None
