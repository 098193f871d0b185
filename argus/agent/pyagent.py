"""Session side of the Python and host channels (argus/bpf/python.bpf.c, host.bpf.c, offcpu.bpf.c).

Per target: find the interpreter and give its offsets to BPF (`py_targets`), keep the
tid -> thread-state map current (`py_threads`), attach the GC USDT probes and precise-mode
probes, resolve walked stacks to frames while the process is alive, symbolise native stacks,
and feed the `python` and `host` sections of the tracker (argus/agent/pysection.py).
"""

from __future__ import annotations

import ctypes
import fnmatch
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from argus.agent.drain import take
from argus.agent.phases import PhaseMatcher
from argus.agent.pysection import HostSection, PythonSection
from argus.probes import cpython, usdt
from argus.probes.cpython import CodeResolver, Frame, Interpreter, ThreadReader
from argus.probes.cpython_offsets import NONE, PY_FRAME_READ
from argus.probes.prologue import plan_entry
from argus.probes.records import PyCfg, RecPyCall, RecPyMark, UsdtArg

OFF_UNKNOWN = 0xFFFFFFFF  # argus/bpf/records.h
PY_STACKS_CAPACITY = 8192
MAX_NATIVE_FRAMES = 24


def period_ns(hz: int) -> int:
    return int(1e9 / hz)


@dataclass(frozen=True)
class PyOptions:
    python: bool = True
    host: bool = True
    hz: int = 49
    host_hz: int = 19
    launch_every: int = 16
    phases: Tuple[Tuple[str, str], ...] = ()
    default_phases: bool = True
    precise: Tuple[str, ...] = ()  # qualname globs timed at every call (opt-in)
    gc: bool = True
    top_stacks: int = 5


@dataclass
class PyTarget:
    pid: int
    interp: Optional[Interpreter] = None
    threads: Optional[ThreadReader] = None
    codes: Optional[CodeResolver] = None
    python: Optional[PythonSection] = None
    host: Optional[HostSection] = None
    frames: Dict[int, List[Frame]] = field(default_factory=dict)  # stack id -> frames, innermost first
    native: Dict[Tuple[int, int, int], str] = field(default_factory=dict)  # (tid, ustack, kstack) -> folded
    semaphores: List[int] = field(default_factory=list)
    known: Dict[int, int] = field(default_factory=dict)  # tid -> thread state written to py_threads
    names: Dict[int, str] = field(default_factory=dict)
    gc: str = "off"  # usdt | absent | off


class PyAgent:
    def __init__(self, bpf: Any, opts: PyOptions, warn: Callable[[str], None]) -> None:
        self.bpf, self.opts, self.warn = bpf, opts, warn
        self.targets: Dict[int, PyTarget] = {}
        self.matcher = PhaseMatcher(opts.phases, opts.default_phases)
        self._attached: Set[Tuple[str, Tuple[int, int]]] = set()
        self._drains = 0
        self._attach_sampling()

    def _attach_sampling(self) -> None:
        from bcc import BPF, PerfSWConfig, PerfType

        if self.opts.python:
            walker = self.bpf.load_func("py_walk_native", BPF.KPROBE)  # native probes tail-call it
            self.bpf["py_walkers"][ctypes.c_int(0)] = ctypes.c_int(walker.fd)
            self.bpf.attach_perf_event(
                ev_type=PerfType.SOFTWARE,
                ev_config=PerfSWConfig.CPU_CLOCK,
                fn_name="py_on_cpu",
                sample_period=period_ns(self.opts.hz),
            )
        if self.opts.host:
            self.bpf.attach_perf_event(
                ev_type=PerfType.SOFTWARE,
                ev_config=PerfSWConfig.CPU_CLOCK,
                fn_name="host_on_cpu",
                sample_period=period_ns(self.opts.host_hz),
            )

    # ---- targets -------------------------------------------------------------------------------------

    def add(self, pid: int, sections: List[Any]) -> PyTarget:
        t = PyTarget(pid)
        interp = cpython.inspect(pid) if self.opts.python else None
        if interp is not None and not interp.offsets.frame_fields_fit():
            self.warn(
                f"pid {pid}: Python {interp.version_text}'s frame layout does not fit the stack walk's "
                f"{PY_FRAME_READ}-byte read: the Python channel skips this process"
            )
            interp = None
        if interp is not None:
            t.interp, t.threads, t.codes = interp, ThreadReader(interp), CodeResolver(interp)
            cfg = self._cfg(interp)
            if self.opts.gc:
                self._attach_gc(t, cfg)
            tbl = self.bpf["py_targets"]
            tbl[ctypes.c_uint32(pid)] = tbl.Leaf.from_buffer_copy(bytes(cfg))
            self.refresh_threads(t)
            t.python = PythonSection(
                pid,
                interp.version_text,
                self.opts.hz,
                self.matcher,
                resolve=functools.partial(self.frames, t),
                code_name=functools.partial(self._code_name, t),
                top_stacks=self.opts.top_stacks,
            )
            sections.append(t.python)
            if self.opts.precise:
                self._attach_precise(interp)
        if self.opts.host:
            t.host = HostSection(
                pid,
                self.opts.host_hz,
                functools.partial(self._native_folded, t),
                functools.partial(self.thread_name, t),
                self.opts.top_stacks,
            )
            sections.append(t.host)
        self.targets[pid] = t
        return t

    def _cfg(self, interp: Interpreter) -> PyCfg:
        o = interp.offsets

        def u(v: int) -> int:
            return OFF_UNKNOWN if v == NONE else v

        return PyCfg(
            version=(interp.version[0] << 8) | interp.version[1],
            flags=0,
            off_tstate_frame=o.tstate_frame,
            off_cframe_frame=u(o.cframe_frame),
            off_frame_code=o.frame_code,
            off_frame_back=o.frame_back,
            off_frame_owner=u(o.frame_owner),
            pad=0,
        )

    def _attach_gc(self, t: PyTarget, cfg: PyCfg) -> None:
        assert t.interp is not None
        path = t.interp.binary.host_path
        start, done = usdt.find(path, "python", "gc__start"), usdt.find(path, "python", "gc__done")
        if start is None or done is None:
            t.gc = "absent"
            key = ("nogc", t.interp.binary.inode)
            if key not in self._attached:
                self._attached.add(key)
                self.warn(
                    f"{t.interp.binary.path} has no python:gc__start/gc__done USDT probes: "
                    "GC pauses are not measured"
                )
            return
        a0 = usdt.parse_arg(start.args[0]) if start.args else None
        a1 = usdt.parse_arg(done.args[0]) if done.args else None
        cfg.gc_start_gen = a0 or UsdtArg()
        cfg.gc_done_collected = a1 or UsdtArg()
        key = ("gc", t.interp.binary.inode)
        if key not in self._attached:
            self.bpf.attach_uprobe(name=path, addr=start.pc, fn_name="py_gc_start")
            self.bpf.attach_uprobe(name=path, addr=done.pc, fn_name="py_gc_done")
            self._attached.add(key)
        for p in (start, done):
            if p.semaphore and usdt.adjust_semaphore(t.pid, t.interp.bias + p.semaphore, +1):
                t.semaphores.append(t.interp.bias + p.semaphore)
        t.gc = "usdt"

    def _attach_precise(self, interp: Interpreter) -> None:
        key = ("precise", interp.binary.inode)
        if key in self._attached:
            return
        sym = interp.elf.symbols.get("_PyEval_EvalFrameDefault")
        if sym is None:
            self.warn(f"{interp.binary.path}: no _PyEval_EvalFrameDefault symbol: --python-precise is off")
            return
        plan = plan_entry(interp.elf.read(sym.offset, 48), interp.binary.host_path, sym.vaddr)
        addr = sym.vaddr + plan.offset
        self.bpf.attach_uprobe(name=interp.binary.host_path, addr=addr, fn_name="py_eval_entry")
        self.bpf.attach_uretprobe(name=interp.binary.host_path, addr=addr, fn_name="py_eval_return")
        self._attached.add(key)
        if interp.version >= (3, 11):
            self.warn(
                f"--python-precise on Python {interp.version_text}: the eval loop is entered only for calls "
                "made from C, so Python->Python calls of the selected functions are not timed"
            )

    def remove(self, pid: int) -> None:
        t = self.targets.get(pid)
        if t is None:
            return
        for addr in t.semaphores:
            usdt.adjust_semaphore(pid, addr, -1)
        t.semaphores.clear()
        if t.python is not None:  # the py_* maps exist only when the Python channel is compiled in
            try:
                del self.bpf["py_targets"][ctypes.c_uint32(pid)]
            except KeyError:
                pass
            tbl = self.bpf["py_threads"]
            for tid in list(t.known):
                try:
                    del tbl[ctypes.c_uint32(tid)]
                except KeyError:
                    pass
        t.known.clear()

    def close(self) -> None:
        for pid in list(self.targets):
            self.remove(pid)

    # ---- threads and names ---------------------------------------------------------------------------

    def refresh_threads(self, t: PyTarget) -> None:
        """tid -> thread state for every thread (0: not a Python thread, so BPF stops asking)."""
        if t.threads is None:
            return
        try:
            tasks = {int(x) for x in os.listdir(f"/proc/{t.pid}/task")}
        except OSError:
            return
        states = t.threads.threads()
        tbl = self.bpf["py_threads"]
        for tid in tasks:
            ts = states.get(tid, 0)
            if t.known.get(tid) != ts:
                tbl[ctypes.c_uint32(tid)] = tbl.Leaf(ts, 0)
                t.known[tid] = ts
        for tid in [x for x in t.known if x not in tasks]:
            try:
                del tbl[ctypes.c_uint32(tid)]
            except KeyError:
                pass
            del t.known[tid]

    def frames(self, t: PyTarget, stack: int) -> Optional[List[Frame]]:
        """The frames of a walked stack (read from the process the first time; None if unknown)."""
        got = t.frames.get(stack)
        if got is not None or t.codes is None or not stack:
            return got
        try:
            raw = self.bpf["py_stacks"][ctypes.c_uint64(stack)]
        except KeyError:
            return None
        # code 0: a C-stack shim frame (3.12+), not a Python function
        codes = [c for c in (int(raw.code[i]) for i in range(min(int(raw.depth), len(raw.code)))) if c]
        frames = t.codes.resolve(codes)
        if any(f.qualname in ("<unreadable>", "<not code>") for f in frames) and not os.path.exists(
            f"/proc/{t.pid}"
        ):
            return None
        t.frames[stack] = frames
        if self.opts.precise:
            self._mark_precise(codes, frames)
        return frames

    def _seen_stack(self, t: PyTarget, k: Any) -> None:
        """A drain saw this stack: named now, while the process is alive (once: per entry, per drain)."""
        stack = k.stack
        if stack not in t.frames:
            self.frames(t, stack)

    def _mark_precise(self, codes: List[int], frames: List[Frame]) -> None:
        tbl = self.bpf["py_precise"]
        for code, f in zip(codes, frames):
            if any(fnmatch.fnmatchcase(f.qualname, p) for p in self.opts.precise):
                tbl[ctypes.c_uint64(code)] = ctypes.c_uint32(1)

    def _code_name(self, t: PyTarget, code: int) -> str:
        return t.codes.resolve([code])[0].qualname if t.codes is not None else f"code@{code:#x}"

    def thread_name(self, t: PyTarget, tid: int) -> str:
        name = t.names.get(tid)
        if name is None:
            try:
                with open(f"/proc/{t.pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = str(tid)
            t.names[tid] = name
        return name

    def _native_folded(self, t: PyTarget, tid: int, ustack: int, kstack: int) -> str:
        key = (tid, ustack, kstack)
        s = t.native.get(key)
        if s is None:
            s = t.native[key] = self.fold_native(t, tid, ustack, kstack)
        return s

    def fold_native(self, t: PyTarget, tid: int, ustack: int, kstack: int) -> str:
        """thread name; user frames (outermost first); kernel frames with `_[k]`."""
        st = self.bpf["stack_traces"]
        parts = [self.thread_name(t, tid)]
        if ustack >= 0:
            try:
                addrs = list(st.walk(ustack))[:MAX_NATIVE_FRAMES]
                parts += [self.bpf.sym(a, t.pid).decode(errors="replace") for a in reversed(addrs)]
            except Exception:  # the process may be gone: keep what we have
                parts.append("[user]")
        if kstack >= 0:
            try:
                addrs = list(st.walk(kstack))[:MAX_NATIVE_FRAMES]
                parts += [self.bpf.ksym(a).decode(errors="replace") + "_[k]" for a in reversed(addrs)]
            except Exception:
                parts.append("[kernel]")
        return ";".join(parts)

    # ---- records and drains --------------------------------------------------------------------------

    def on_record(self, rec: Any) -> bool:
        """Python records go to their section (True); others are not ours (False)."""
        kind = type(rec)
        if kind is not RecPyMark and kind is not RecPyCall:
            return False  # most records (collectives, syncs): one test, not two
        if isinstance(rec, RecPyMark):
            t = self.targets.get(rec.h.tgid)
            if t is not None and t.python is not None:
                self.frames(t, rec.stack)
                t.python.on_mark(rec)
            return True
        t = self.targets.get(rec.h.tgid)  # a RecPyCall
        if t is not None and t.python is not None:
            t.python.on_call(rec)
        return True

    def drain(self, final: Dict[int, int], final_before: Dict[int, int]) -> None:
        """Feed every complete epoch of the Python and host maps to the sections (the session's
        drain, argus/agent/drain.py, with the same epochs)."""
        self._drains += 1
        for t in self.targets.values():
            self.refresh_threads(t)
        if self.opts.python:
            self.bpf["py_unknown"].clear()  # every thread list was just re-read
            take(
                self.bpf["py_prof"],
                self.targets,
                final,
                final_before,
                lambda t, k, v: (
                    t.python.add_prof(k.epoch, k.tid, k.stack, k.kind, v.count, v.ns) if t.python else None
                ),
                seen=self._seen_stack,  # resolved while the process is alive
            )
            take(
                self.bpf["py_owed"],
                self.targets,
                final,
                final_before,
                lambda t, k, v: t.python.add_owed(k.epoch, k.stack, k.call, v.value) if t.python else None,
                seen=self._seen_stack,
            )
            take(
                self.bpf["py_gc"],
                self.targets,
                final,
                final_before,
                lambda t, k, v: (
                    t.python.add_gc(k.epoch, k.gen, v.count, v.ns, v.max_ns, v.collected)
                    if t.python
                    else None
                ),
            )
            if self._drains % 10 == 0:
                self._trim_stacks()
        if self.opts.host:
            take(
                self.bpf["host_prof"],
                self.targets,
                final,
                final_before,
                lambda t, k, v: (
                    t.host.add_prof(k.epoch, k.tid, k.ustack, k.kstack, k.kind, v.count, v.ns)
                    if t.host
                    else None
                ),
                seen=lambda t, k: self._native_folded(t, k.tid, k.ustack, k.kstack),
            )
        if self._drains % 30 == 0:
            self._trim_offcpu()

    def _trim_stacks(self) -> None:
        """Keep the stack map from filling: drop entries already resolved (BPF re-adds them)."""
        tbl = self.bpf["py_stacks"]
        keys = list(tbl.keys())
        if len(keys) < PY_STACKS_CAPACITY * 3 // 4:
            return
        resolved = {s for t in self.targets.values() for s in t.frames}
        for k in keys:
            if int(k.value) in resolved:
                try:
                    del tbl[k]
                except KeyError:
                    pass

    def _trim_offcpu(self) -> None:
        """Switch-out entries of threads that exited (never switched in again)."""
        tbl = self.bpf["offcpu_starts"]
        for k, v in list(tbl.items()):
            if not os.path.exists(f"/proc/{v.tgid}/task/{k.value}"):
                try:
                    del tbl[k]
                except KeyError:
                    pass
