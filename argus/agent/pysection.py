"""The `python` and `host_cpu` sections of a step summary: per-epoch accumulators, pure.

The session feeds drained map entries (`add_prof`, `add_gc`) and ring records (`on_mark`,
`on_call`); the tracker asks each section for the epochs of one step (`summarize`). Names come
from injected resolvers, so tests feed plain data.

Phase time of a thread = on-CPU samples x the sampling period + measured off-CPU time, each
attributed to the phase of the stack it was taken with (docs/probe.md, "Python phases").
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from argus.agent.phases import OTHER, PhaseMatcher, fold
from argus.probes import base
from argus.probes.cpython import Frame
from argus.probes.records import PROF_OFFCPU, PROF_ONCPU, RecElapsed, RecPyCall, RecPyMark

MAX_MARKS = 20000  # recent native-call walks kept for labelling timers
MAX_EPOCHS = 4096
StackResolver = Callable[[int], Optional[List[Frame]]]  # stack id -> frames, innermost first


# the `calls` key a native call's walk counts under, by the call table's class of the call (a graph
# launch is none of these: other_calls)
_MARK_KEYS = {
    base.LAUNCH: "launches",
    base.SYNC: "syncs",
    base.EVENT_RECORD: "event_records",
    base.COLLECTIVE: "collectives",
    base.P2P: "collectives",
}


@functools.cache  # per mark record: a call id's key is looked up once (ids never change)
def mark_key(call: int) -> str:
    return _MARK_KEYS.get(base.call_class(call), "other_calls")


@dataclass
class _PyEpoch:
    prof: Dict[Tuple[int, int, int], List[int]] = field(default_factory=dict)  # (tid, stack, kind) -> [n, ns]
    marks: Counter = field(default_factory=Counter)  # (stack, class) -> weighted calls
    gc: Dict[int, List[int]] = field(default_factory=dict)  # gen -> [count, ns, max_ns, collected]
    calls: List[RecPyCall] = field(default_factory=list)


class PythonSection:
    name = "python"

    def __init__(
        self,
        pid: int,
        version: str,
        hz: int,
        matcher: PhaseMatcher,
        resolve: StackResolver,
        code_name: Callable[[int], str],
        top_stacks: int = 5,
        stack_chars: int = 120,
    ) -> None:
        self.pid, self.version, self.hz = pid, version, hz
        self.matcher, self.resolve, self.code_name = matcher, resolve, code_name
        self.top_stacks, self.stack_chars = top_stacks, stack_chars
        self.data: Dict[int, _PyEpoch] = {}
        # recent native-call walks, in arrival order (= time order: one ring buffer, stamped at
        # reservation), for labelling timers by bisection
        self.mark_ts: List[int] = []
        self.mark_stack: List[int] = []
        self._phase: Dict[int, str] = {0: OTHER}
        self._folded: Dict[int, str] = {}

    def _epoch(self, e: int) -> _PyEpoch:
        d = self.data.get(e)
        if d is None:
            d = self.data[e] = _PyEpoch()
            if len(self.data) > MAX_EPOCHS:
                self.data.pop(min(self.data))
        return d

    # ---- inputs ----------------------------------------------------------------------------------

    def add_prof(self, epoch: int, tid: int, stack: int, kind: int, count: int, ns: int) -> None:
        v = self._epoch(epoch).prof.setdefault((tid, stack, kind), [0, 0])
        v[0] += count
        v[1] += ns

    def on_mark(self, r: RecPyMark) -> None:
        h, stack = r.h, r.stack  # (each read of a ctypes member makes an object: once)
        marks = self._epoch(h.epoch).marks
        marks[(stack, mark_key(h.call))] += r.weight
        # event records are not walked (argus/bpf/python.bpf.c, PY_HIT_EVENT): they force a walk at the
        # thread's next launch, which counts them and gives them its phase
        if r.events:
            marks[(stack, "event_records")] += r.events
        self.mark_ts.append(h.ts)
        self.mark_stack.append(stack)
        if len(self.mark_ts) > 2 * MAX_MARKS:
            del self.mark_ts[:MAX_MARKS], self.mark_stack[:MAX_MARKS]

    def add_owed(self, epoch: int, stack: int, call: int, weight: int) -> None:
        """Calls not walked (a walk of their thread was too recent: argus/bpf/python.bpf.c), counted
        in BPF to the stack of that walk."""
        self._epoch(epoch).marks[(stack, mark_key(call))] += weight

    def add_gc(self, epoch: int, gen: int, count: int, ns: int, max_ns: int, collected: int) -> None:
        g = self._epoch(epoch).gc.setdefault(gen, [0, 0, 0, 0])
        g[0] += count
        g[1] += ns
        g[2] = max(g[2], max_ns)
        g[3] += collected

    def on_call(self, r: RecPyCall) -> None:
        self._epoch(r.h.epoch).calls.append(r)

    def epochs(self) -> Set[int]:
        return set(self.data)

    # ---- names -----------------------------------------------------------------------------------

    def phase(self, stack: int) -> str:
        p = self._phase.get(stack)
        if p is None:
            frames = self.resolve(stack)
            if frames is None:
                return OTHER  # not resolvable (yet): do not cache
            p = self._phase[stack] = self.matcher.phase_of(frames)
        return p

    def folded(self, stack: int) -> str:
        s = self._folded.get(stack)
        if s is None:
            frames = self.resolve(stack)
            if frames is None:
                return f"stack@{stack:#x}"
            s = self._folded[stack] = fold(frames, self.stack_chars)
        return s

    # ---- output ----------------------------------------------------------------------------------

    def summarize(self, epochs: Sequence[int], timers: Iterable[RecElapsed] = ()) -> Optional[dict]:
        data = [self.data.pop(e) for e in epochs if e in self.data]
        if not data:
            return None
        per_thread: Dict[int, Counter] = {}
        samples: Counter = Counter()
        offcpu: Counter = Counter()
        by_stack: Counter = Counter()
        for d in data:
            for (tid, stack, kind), (n, ns) in d.prof.items():
                per_thread.setdefault(tid, Counter())[self.phase(stack)] += ns
                by_stack[stack] += ns
                if kind == PROF_ONCPU:
                    samples[tid] += n
                elif kind == PROF_OFFCPU:
                    offcpu[tid] += ns
        main = (
            self.pid
            if self.pid in per_thread
            else max(per_thread, key=lambda t: sum(per_thread[t].values()), default=None)
        )
        out: dict = {"version": self.version, "hz": self.hz}
        phases = per_thread.get(main, Counter()) if main is not None else Counter()
        out["thread"] = main
        out["phases"] = {k: int(v) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}
        out["samples"] = int(samples.get(main, 0)) if main is not None else 0
        out["offcpu_ns"] = int(offcpu.get(main, 0)) if main is not None else 0
        others = {t: c for t, c in per_thread.items() if t != main}
        if others:
            out["threads"] = {
                str(t): {"ns": int(sum(c.values())), "phase": c.most_common(1)[0][0]}
                for t, c in others.items()
            }
        out["stacks"] = {self.folded(s): int(ns) for s, ns in by_stack.most_common(self.top_stacks) if ns}
        calls: Dict[str, Counter] = {}
        for d in data:
            for (stack, cls), w in d.marks.items():
                calls.setdefault(self.phase(stack), Counter())[cls] += w
        if calls:
            out["calls"] = {p: dict(c) for p, c in calls.items()}
        gpu = self._label_timers(timers)
        if gpu:
            out["gpu_phases"] = gpu
        gc = self._gc(data)
        if gc:
            out["gc"] = gc
        precise = self._precise(data)
        if precise:
            out["precise"] = precise
        return out

    def _label_timers(self, timers: Iterable[RecElapsed]) -> Dict[str, int]:
        """A framework timer (cuEventElapsedTime of two recorded events) gets the phase the host was
        in between the two records: the majority of the native-call walks in that interval."""
        from argus.agent.tracker import _ms

        out: Counter = Counter()
        for t in timers:
            if t.result != 0:
                continue
            # the two recordings as they were at the read (BPF: argus/bpf/cuda.bpf.c)
            t0, t1 = t.start_ns, t.end_ns
            if not t0 or not t1 or t1 <= t0:
                continue
            lo, hi = bisect.bisect_right(self.mark_ts, t0), bisect.bisect_left(self.mark_ts, t1)
            votes: Counter = Counter(self.phase(s) for s in self.mark_stack[lo:hi])
            named = [(p, n) for p, n in votes.most_common() if p != OTHER]
            phase = named[0][0] if named else OTHER
            out[phase] += round(_ms(t.ms_bits) * 1e6)
        return {k: int(v) for k, v in out.items()}

    @staticmethod
    def _gc(data: List[_PyEpoch]) -> Optional[dict]:
        by_gen: Dict[int, List[int]] = {}
        for d in data:
            for gen, (n, ns, mx, coll) in d.gc.items():
                g = by_gen.setdefault(gen, [0, 0, 0, 0])
                g[0] += n
                g[1] += ns
                g[2] = max(g[2], mx)
                g[3] += coll
        if not by_gen:
            return None
        return {
            "count": sum(g[0] for g in by_gen.values()),
            "pause_ns": sum(g[1] for g in by_gen.values()),
            "max_ns": max(g[2] for g in by_gen.values()),
            "collected": sum(g[3] for g in by_gen.values()),
            "by_gen": {str(k): {"count": g[0], "pause_ns": g[1]} for k, g in sorted(by_gen.items())},
        }

    def _precise(self, data: List[_PyEpoch]) -> Optional[dict]:
        out: Dict[str, Dict[str, int]] = {}
        for d in data:
            for r in d.calls:
                p = out.setdefault(self.code_name(r.code), {"count": 0, "ns": 0, "max_ns": 0})
                dur = max(0, r.h.ts - r.enter_ns)
                p["count"] += 1
                p["ns"] += dur
                p["max_ns"] = max(p["max_ns"], dur)
        return out or None


NativeFolder = Callable[[int, int, int], str]  # (tid, user stack id, kernel stack id) -> folded


class HostSection:
    name = "host_cpu"  # not "host": that is the identity field of every summary

    def __init__(
        self, pid: int, hz: int, folder: NativeFolder, thread_name: Callable[[int], str], top_stacks: int = 5
    ) -> None:
        self.pid, self.hz, self.folder, self.thread_name = pid, hz, folder, thread_name
        self.top_stacks = top_stacks
        self.data: Dict[int, Dict[Tuple[int, int, int, int], List[int]]] = {}

    def add_prof(
        self, epoch: int, tid: int, ustack: int, kstack: int, kind: int, count: int, ns: int
    ) -> None:
        d = self.data.get(epoch)
        if d is None:
            d = self.data[epoch] = {}
            if len(self.data) > MAX_EPOCHS:
                self.data.pop(min(self.data))
        v = d.setdefault((tid, ustack, kstack, kind), [0, 0])
        v[0] += count
        v[1] += ns

    def epochs(self) -> Set[int]:
        return set(self.data)

    def summarize(self, epochs: Sequence[int], timers: Iterable[RecElapsed] = ()) -> Optional[dict]:
        data = [self.data.pop(e) for e in epochs if e in self.data]
        if not data:
            return None
        threads: Dict[int, List[int]] = {}
        stacks: Counter = Counter()
        for d in data:
            for (tid, u, k, kind), (_n, ns) in d.items():
                t = threads.setdefault(tid, [0, 0])
                t[0 if kind == PROF_ONCPU else 1] += ns
                stacks[self.folder(tid, u, k)] += ns
        return {
            "hz": self.hz,
            "on_cpu_ns": sum(t[0] for t in threads.values()),
            "off_cpu_ns": sum(t[1] for t in threads.values()),
            "threads": {
                str(tid): {"name": self.thread_name(tid), "on_ns": on, "off_ns": off}
                for tid, (on, off) in sorted(threads.items(), key=lambda kv: -sum(kv[1]))[:16]
            },
            "stacks": {s: int(ns) for s, ns in stacks.most_common(self.top_stacks) if ns},
        }
