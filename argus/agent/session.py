"""The probing session: load BPF, attach, register target processes, and turn ring records and
drained maps into per-step summaries. A coordinator: attaching is argus/agent/attach.py, reading
the maps argus/agent/drain.py, a process's state argus/agent/targets.py, its steps
argus/agent/tracker.py, the Python and host channels argus/agent/pyagent.py.

One session serves many processes: adding a process never recompiles. The loop never blocks the
targets: BPF programs only count and append; all work happens here, on the agent's time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from argus.agent import bpfprog, clock, drain
from argus.agent.attach import ALL_CHANNELS, AUX_CHANNELS, Attacher, SlowProbe, image_of, inspect
from argus.agent.attachscan import AttachScans
from argus.agent.identity import Identity
from argus.agent.keeper import Keeper, close_fds
from argus.agent.targets import Identities, Target, execed, exited, read_process
from argus.agent.tracker import RankTracker
from argus.errors import ArgusError
from argus.probes import cpython, libnccl
from argus.probes.base import Channel, call_channel, call_name
from argus.probes.records import DecodeError, RecPyCall, RecPyMark, TargetCfg, decode_from
from argus.schema import RankStep, to_probe_json

PY_RECORDS = frozenset((RecPyMark, RecPyCall))  # the Python channel's: its section takes them


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
        self.targets: Dict[int, Target] = {}
        self.health = Health()
        self._layouts: Dict[Tuple[int, int], libnccl.CommLayout] = {}
        self.scans = AttachScans()  # threads already blocked in a probed call when we attached
        # pid -> tid -> ts of its latest ring record, for pids with threads blocked at attach only
        self.last_record: Dict[int, Dict[int, int]] = {}
        self.identities = Identities()
        self._channel_names = frozenset(c.name for c in self.channels)
        bpfprog.preflight()
        self.bpf: Any = bpfprog.load(self.channels, self.opts)
        # a copy of every uprobe's perf fd in a second process: the probes come out of the job
        # even when we are killed with SIGKILL (argus/agent/keeper.py)
        self.keeper = Keeper()
        if not self.keeper.start():
            self.health.warnings.append(
                f"{self.keeper.error}: a SIGKILL of the agent may leave probes behind"
            )
        self.attacher = Attacher(self.bpf, self.opts, self.keeper, self.health, launch_window)
        _open_ring(self.bpf, "records", self._on_ring)
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
            self.attacher.library(pid, lp)
        if self.step_fn:
            self.attacher.step_fn(pid, self.step_fn)
        tracker = RankTracker(
            identity,
            layout,
            read_mem=functools.partial(read_process, pid),
            step_fn=self.step_fn is not None,
            coll_records=0 if self.opts.record else self.opts.coll_records,
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
        # per-process BPF state keyed by pid alone (a long --all run sees many processes)
        for name in ("targets", "stream_ops", "near_colls"):
            try:
                del self.bpf[name][ctypes.c_uint32(pid)]
            except KeyError:  # no such entry, or no such map without its channel
                pass
        if "nccl" in self._channel_names:
            drain.forget_samples(self.bpf, pid)
        if self.py is not None:
            self.py.remove(pid)
        self.scans.forget(pid)
        self.last_record.pop(pid, None)
        self.identities.forget(pid)

    def execed(self) -> List[int]:
        """Live targets that ran exec since they were added (argus/agent/targets.py)."""
        return execed(self.targets)

    def forget(self, pid: int) -> None:
        """Drop a removed target whose tail was flushed (the pid runs a new program, added anew)."""
        t = self.targets.get(pid)
        if t is not None and not t.alive and t.flushed:
            del self.targets[pid]

    def exited(self) -> List[int]:
        """Targets whose process is gone but that are still tracked (see `reap`)."""
        return exited(self.targets)

    def reap(self, gone: List[int]) -> List[int]:
        """Stop tracking the exited targets `gone` (from `exited`); their remaining steps are flushed."""
        for pid in gone:
            self.remove(pid)
        return gone

    def reread_identities(self, job: Optional[str], host: Optional[str]) -> None:
        """Targets without a rank yet: read their live environment again (argus/agent/targets.py)."""
        self.identities.reread(self.targets, job, host)

    def take_identity_changes(self) -> List[Tuple[Target, Identity]]:
        """(target, its identity before) for each target whose identity changed since the last call."""
        return self.identities.take_changes()

    def poll_windows(self) -> None:
        """Attach or detach the launch probes when their window says so (cheap: call it often)."""
        self.attacher.poll_windows()

    # ---- the loop ------------------------------------------------------------------------------------

    def _on_ring(self, _ctx: Any, data: Any, size: int) -> int:
        # called by libbpf straight (_open_ring): an int, always, and nothing raised but what a bug raises
        try:
            rec = decode_from((ctypes.c_char * size).from_address(data), 0, size)  # (ctypes caches the type)
        except DecodeError:
            self.health.decode_errors += 1
            return 0
        self._on_record(rec)
        return 0

    def _on_record(self, rec: Any) -> None:
        if type(rec) in PY_RECORDS and self.py is not None:
            self.py.on_record(rec)
            return
        tgid = rec.h.tgid
        if tgid in self.scans.blocked_pids:  # a thread found blocked at attach: has it left?
            h = rec.h
            seen = self.last_record.get(tgid)
            if seen is None:
                seen = self.last_record[tgid] = {}
            seen[h.tid] = h.ts
        t = self.targets.get(tgid)
        if t is not None:
            t.tracker.on_record(rec)

    def consume(self) -> None:
        self.bpf.ring_buffer_consume()

    def drain(self) -> None:
        """Read every channel's aggregation maps into the trackers and sections (argus/agent/drain.py)."""
        targets = self.targets
        final_before = {pid: t.final_before for pid, t in targets.items()}
        final = drain.final_epochs(self.bpf, targets)
        drain.drain_counts(self.bpf, targets, final, final_before, self._channel_names)
        if self.py is not None:
            self.py.drain(final, final_before)
        if "nccl" in self._channel_names:
            drain.read_samples(self.bpf, targets)
        for pid, t in targets.items():
            t.final_before = max(t.final_before, final[pid])
        drain.read_drops(self.bpf, targets, self.health.drops)

    def rank_steps(self) -> List[RankStep]:
        """Complete steps of every target since the last call."""
        self.identities.learn(self.targets)
        wall, err = clock.wall_offset()
        out: List[RankStep] = []
        for t in self.targets.values():
            out.extend(t.tracker.finalize_steps(t.final_before, wall, err))
            self.health.left_out.update(t.tracker.take_left_out())
            if t.alive:
                drain.ask_samples(self.bpf, t.pid, t.tracker.take_samples())
            if not t.alive and not t.flushed:
                t.flushed = True
                tail = t.tracker.flush_tail_step(wall, err)
                if tail is not None:
                    out.append(tail)
        windows = self.attacher.windows
        if windows is not None:
            windows.label(out)
            windows.observe(rs.duration_ns for rs in out if rs.step is not None)
            self.attacher.poll_windows()
        return out

    def steps(self) -> List[dict]:
        """`rank_steps` as the `--json` objects (argus.schema.to_probe_json)."""
        return [to_probe_json(rs) for rs in self.rank_steps()]

    def inflight(self) -> List[dict]:
        """Calls entered and not returned (what a hung rank is blocked in)."""
        now = time.monotonic_ns()
        out = []
        for k, v in self.bpf["inflight_calls"].items():
            # enter_ns 0: returned (entries are kept and rewritten per thread, argus.h)
            if v.enter_ns and v.tgid in self.targets:
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
            close_fds(list(self.bpf.uprobe_fds.values()))
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


def _open_ring(bpf: Any, name: str, cb: Callable[[Any, Any, int], int]) -> None:
    """Our callback called straight from libbpf's loop. bcc's `open_ring_buffer` wraps it in a Python
    function (a frame, a try and an int() per record: a tenth of the agent's cost per record at tensor-
    parallel rates); `cb` returns an int and raises nothing, so the wrapper adds nothing."""
    tbl = bpf[name]
    try:
        from bcc.libbcc import _RINGBUF_CB_TYPE

        fn = _RINGBUF_CB_TYPE(cb)
        bpf._open_ring_buffer(tbl.map_fd, fn, None)
    except (ImportError, AttributeError):  # another bcc: its own wrapper
        tbl.open_ring_buffer(cb)
        return
    tbl._cbs[0] = fn  # bcc keeps it alive there, as open_ring_buffer does
