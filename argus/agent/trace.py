"""Chrome / Perfetto trace JSON from the records of an `argus record` window. Pure.

Tracks (Chrome "threads") per rank process:
  <thread> TID           every CUDA/NCCL call of the thread (complete events, host time), syncs,
                         timers read (instants), GC pauses
  <thread> TID python    the sampled Python stack as a flame chart (on-CPU samples and off-CPU
                         spans, each spanning until the next observation)
  <thread> TID off-CPU   every off-CPU span with its phase, Python and kernel stacks
  <thread> TID precise   calls of --python-precise functions
  stream 0x...           what was enqueued on each CUDA stream, at host enqueue time (the GPU-side
                         execution times are not observed)
Times are microseconds from the start of the window (`otherData.t0_monotonic_ns`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from argus.probes.base import ENQUEUE, LAUNCH, call_class, call_name
from argus.probes.cpython import Frame
from argus.probes.records import (
    RecCall,
    RecElapsed,
    RecEventRecord,
    RecFuncName,
    RecGc,
    RecNccl,
    RecOffcpu,
    RecPyCall,
    RecPySample,
    RecSync,
)

PY_TRACK, OFF_TRACK, PRECISE_TRACK, STREAM_TRACK = 4_200_000, 8_400_000, 12_600_000, 16_800_000
PHASES = {"X", "i", "I", "M", "C", "B", "E"}


@dataclass
class Names:
    """What the records refer to, resolved by the caller while the processes were alive."""

    frames: Callable[[int, int], Optional[List[Frame]]]  # (pid, stack id) -> frames, innermost first
    phase: Callable[[int, int], str]  # (pid, stack id) -> phase
    native: Callable[[int, int, int, int], str] = lambda _p, _t, _u, _k: ""  # folded native stack
    thread: Callable[[int, int], str] = lambda _p, t: str(t)  # (pid, tid) -> name
    code: Callable[[int, int], str] = lambda _p, c: f"code@{c:#x}"  # (pid, code) -> qualname
    rank: Dict[int, int] = field(default_factory=dict)  # pid -> rank
    period_ns: int = 10_101_010  # Python sampling period


def _us(ns: int, t0: int) -> float:
    return round((ns - t0) / 1000.0, 3)


class TraceBuilder:
    def __init__(self, names: Names, t0: int) -> None:
        self.n, self.t0 = names, t0
        self.events: List[dict] = []
        self.threads: Dict[Tuple[int, int], str] = {}
        self.streams: Dict[Tuple[int, int], int] = {}
        self.kernels: Dict[int, str] = {}

    def _thread(self, pid: int, tid: int, track: int = 0, suffix: str = "") -> int:
        vt = tid + track
        if (pid, vt) not in self.threads:
            self.threads[(pid, vt)] = f"{self.n.thread(pid, tid)} {tid}{suffix}"
        return vt

    def _stream(self, pid: int, handle: int) -> int:
        key = (pid, handle)
        if key not in self.streams:
            vt = STREAM_TRACK + len(self.streams)
            self.streams[key] = vt
            self.threads[(pid, vt)] = f"stream {handle:#x}" if handle else "stream 0 (default)"
        return self.streams[key]

    def _x(
        self, name: str, cat: str, pid: int, tid: int, start: int, end: int, args: Optional[dict] = None
    ) -> None:
        start = max(start, self.t0)  # spans that began before the window are cut at its start
        ev = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start, self.t0)}
        ev["dur"] = max(0.0, round((end - start) / 1000.0, 3))
        if args:
            ev["args"] = args
        self.events.append(ev)

    def _i(self, name: str, cat: str, pid: int, tid: int, ts: int, args: Optional[dict] = None) -> None:
        ev = {
            "name": name,
            "cat": cat,
            "ph": "i",
            "s": "t",
            "pid": pid,
            "tid": tid,
            "ts": _us(max(ts, self.t0), self.t0),
        }
        if args:
            ev["args"] = args
        self.events.append(ev)

    # ---- records ---------------------------------------------------------------------------------

    def add(self, records: Iterable[Any]) -> None:
        recs = sorted(records, key=lambda r: r.h.ts)
        for r in recs:
            if isinstance(r, RecFuncName) and r.result == 0 and r.func:
                self.kernels[r.func] = r.name.decode(errors="replace")
        samples: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = {}
        for r in recs:
            pid, tid = r.h.tgid, r.h.tid
            if isinstance(r, RecCall):
                self._call(r)
            elif isinstance(r, RecSync):
                name = call_name(r.h.call)
                self._x(
                    name,
                    "cuda.sync",
                    pid,
                    self._thread(pid, tid),
                    r.enter_ns,
                    r.h.ts,
                    {"handle": f"{r.handle:#x}", "result": r.result},
                )
            elif isinstance(r, RecNccl):
                name = call_name(r.h.call)
                args = {
                    "comm": f"{r.comm:#x}",
                    "seq": r.seq,
                    "count": r.count,
                    "peer": r.peer,
                    "result": r.result,
                }
                if name == "ncclGroupEnd":  # runs the group's operations: no communicator or stream
                    args = {"result": r.result}
                self._x(name, "nccl", pid, self._thread(pid, tid), r.enter_ns, r.h.ts, args)
                if name != "ncclGroupEnd":
                    self._x(name, "nccl.enqueue", pid, self._stream(pid, r.stream), r.enter_ns, r.h.ts, args)
            elif isinstance(r, RecEventRecord):
                self._i(
                    "cuEventRecord",
                    "cuda",
                    pid,
                    self._stream(pid, r.stream),
                    r.h.ts,
                    {"event": f"{r.event:#x}"},
                )
            elif isinstance(r, RecElapsed) and r.result == 0:
                from argus.agent.tracker import _ms

                self._i(
                    "timer",
                    "cuda.timer",
                    pid,
                    self._thread(pid, tid),
                    r.h.ts,
                    {"ms": _ms(r.ms_bits), "start": f"{r.start_ev:#x}", "end": f"{r.end_ev:#x}"},
                )
            elif isinstance(r, RecGc):
                self._x(
                    f"gc gen {r.generation}",
                    "python.gc",
                    pid,
                    self._thread(pid, tid),
                    r.start_ns,
                    r.h.ts,
                    {"collected": r.collected},
                )
            elif isinstance(r, RecPyCall):
                self._x(
                    self.n.code(pid, r.code),
                    "python.precise",
                    pid,
                    self._thread(pid, tid, PRECISE_TRACK, " precise"),
                    r.enter_ns,
                    r.h.ts,
                )
            elif isinstance(r, RecPySample):
                samples.setdefault((pid, tid), []).append((r.h.ts, r.h.ts + self.n.period_ns, r.stack))
            elif isinstance(r, RecOffcpu):
                self._offcpu(r)
                if r.stack:
                    samples.setdefault((pid, tid), []).append((r.start_ns, r.h.ts, r.stack))
        for (pid, tid), obs in samples.items():
            self._flame(pid, tid, sorted(obs))

    def _call(self, r: RecCall) -> None:
        pid, tid = r.h.tgid, r.h.tid
        name = call_name(r.h.call)
        cls = call_class(r.h.call)
        args: Dict[str, Any] = {}
        if cls == LAUNCH:  # its argument is the CUfunction (a graph launch's is the graph)
            args["kernel"] = self.kernels.get(r.arg, f"fn@{r.arg:#x}")
        elif r.arg:
            args["bytes"] = r.arg
        self._x(name, "cuda", pid, self._thread(pid, tid), r.enter_ns, r.h.ts, args)
        if cls == LAUNCH or cls == ENQUEUE:
            label = args.get("kernel", name)
            self._x(str(label), "cuda.enqueue", pid, self._stream(pid, r.stream), r.enter_ns, r.h.ts, args)

    def _offcpu(self, r: RecOffcpu) -> None:
        pid, tid = r.h.tgid, r.h.tid
        phase = self.n.phase(pid, r.stack) if r.stack else "-"
        args: Dict[str, Any] = {"phase": phase}
        frames = self.n.frames(pid, r.stack) if r.stack else None
        if frames:
            args["python"] = ";".join(f.qualname for f in reversed(frames))
        native = self.n.native(pid, tid, r.ustack, r.kstack)
        if native:
            args["native"] = native
        self._x(
            f"off-CPU ({phase})",
            "offcpu",
            pid,
            self._thread(pid, tid, OFF_TRACK, " off-CPU"),
            r.start_ns,
            r.h.ts,
            args,
        )

    def _flame(self, pid: int, tid: int, obs: Sequence[Tuple[int, int, int]]) -> None:
        """Nested slices from stack observations: a frame stays open while consecutive observations
        share it; a gap longer than two sampling periods closes everything."""
        vt = self._thread(pid, tid, PY_TRACK, " python")
        open_: List[Tuple[str, int]] = []
        last_end = None
        for start, end, stack in obs:
            frames = self.n.frames(pid, stack) or []
            names = [f.qualname for f in reversed(frames)]
            if last_end is not None and start > last_end + 2 * self.n.period_ns:
                self._close(pid, vt, open_, 0, last_end)
            start = max(start, last_end or start)
            keep = 0
            while keep < min(len(open_), len(names)) and open_[keep][0] == names[keep]:
                keep += 1
            self._close(pid, vt, open_, keep, start)
            open_.extend((n, start) for n in names[keep:])
            last_end = max(end, start)
        if last_end is not None:
            self._close(pid, vt, open_, 0, last_end)

    def _close(self, pid: int, vt: int, open_: List[Tuple[str, int]], keep: int, at: int) -> None:
        while len(open_) > keep:
            name, start = open_.pop()
            self._x(name, "python", pid, vt, start, at)

    # ---- output ----------------------------------------------------------------------------------

    def trace(self, meta: Optional[dict] = None) -> dict:
        out: List[dict] = []
        for pid in sorted({p for p, _ in self.threads}):
            rank = self.n.rank.get(pid, -1)
            if rank >= 0:  # viewers add the pid themselves ("rank 3 (pid 4242)"); else they show it alone
                label = {"name": f"rank {rank}"}
                out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": label})
            out.append(
                {
                    "name": "process_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "args": {"sort_index": rank if rank >= 0 else pid},
                }
            )
        for (pid, vt), name in sorted(self.threads.items()):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": vt, "args": {"name": name}})
            out.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": vt, "args": {"sort_index": vt}}
            )
        events = sorted(self.events, key=lambda e: (e["pid"], e["tid"], e["ts"], -e.get("dur", 0)))
        return {
            "traceEvents": out + events,
            "displayTimeUnit": "ms",
            "otherData": {"t0_monotonic_ns": self.t0, "generator": "argus record", **(meta or {})},
        }


def validate(trace: Any) -> List[str]:
    """Problems that would make a trace viewer reject or misdraw it (empty when valid)."""
    errs: List[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents list"]
    spans: Dict[Tuple[int, int], List[Tuple[float, float]]] = {}
    for i, ev in enumerate(trace["traceEvents"]):
        where = f"event {i}"
        if not isinstance(ev, dict):
            errs.append(f"{where}: not an object")
            continue
        ph = ev.get("ph")
        if ph not in PHASES:
            errs.append(f"{where}: bad ph {ph!r}")
        if not isinstance(ev.get("name"), str):
            errs.append(f"{where}: name must be a string")
        if not isinstance(ev.get("pid"), int) or not isinstance(ev.get("tid"), int):
            errs.append(f"{where}: pid and tid must be integers")
        if "args" in ev and not isinstance(ev["args"], dict):
            errs.append(f"{where}: args must be an object")
        if ph == "M":
            if not isinstance(
                ev.get("args", {}).get("name", ev.get("args", {}).get("sort_index")), (str, int)
            ):
                errs.append(f"{where}: metadata without args.name / args.sort_index")
            continue
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)) or ts < 0:
            errs.append(f"{where}: ts must be a number >= 0")
            continue
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                errs.append(f"{where}: X needs dur >= 0")
                continue
            spans.setdefault((ev["pid"], ev["tid"]), []).append((float(ts), float(ts) + float(dur)))
        if len(errs) > 50:
            break
    for (pid, tid), ss in spans.items():
        stack: List[float] = []
        for s, e in sorted(ss, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= s + 1e-3:
                stack.pop()
            if stack and e > stack[-1] + 1e-3:
                errs.append(
                    f"pid {pid} tid {tid}: slice [{s}, {e}] overlaps its parent ending at {stack[-1]}"
                )
                break
            stack.append(e)
    return errs
