"""`argus record`: a bounded, full-detail window as a Chrome/Perfetto trace.

Unlike `argus probe` (aggregated in the kernel, a summary per step), the record build of the BPF
programs (-DARGUS_RECORD) also emits one record per CUDA call, Python sample, off-CPU span and GC
pause; they are kept in memory for the window and written as trace JSON (argus/agent/trace.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Dict, List, Optional, Tuple

import click

from argus.agent import bpfprog, identity, pyopts
from argus.agent import session as sess
from argus.agent.attach import inspect
from argus.agent.commands import DurationType
from argus.agent.phases import OTHER
from argus.agent.targets import process_gone
from argus.agent.trace import Names, TraceBuilder, validate
from argus.errors import NoSuchProcess, UsageError
from argus.probes.records import RecFuncName, RecOffcpu, RecPySample

MAX_RECORDS = 2_000_000  # a memory bound for very busy windows (then records are counted, dropped)


class RecordSession(sess.Session):
    """A Session that also keeps every ring record of the window."""

    kept: List[Any]
    dropped: int = 0

    def _on_record(self, rec: Any) -> None:
        if rec.h.tgid in self.targets:
            if len(self.kept) < MAX_RECORDS:
                self.kept.append(rec)
            else:
                self.dropped += 1
        super()._on_record(rec)


@click.command("record")
@click.option(
    "-p", "--pid", "pids", type=int, multiple=True, required=True, metavar="PID", help="Process (repeatable)."
)
@click.option(
    "-d", "--duration", type=DurationType(), default="10s", show_default=True, help="Length of the window."
)
@click.option(
    "-o", "--output", default="trace.json", show_default=True, metavar="FILE", help="Trace JSON to write."
)
@click.option("--no-cuda", is_flag=True, help="Skip the CUDA channel.")
@click.option("--no-nccl", is_flag=True, help="Skip the NCCL channel.")
@click.option(
    "--ringbuf-pages", type=int, default=4096, show_default=True, help="Ring buffer pages (16 MiB)."
)
@pyopts.python_options
def record_cmd(
    pids: Tuple[int, ...],
    duration: float,
    output: str,
    no_cuda: bool,
    no_nccl: bool,
    ringbuf_pages: int,
    **aux: Any,
) -> int:
    """Record a full-detail window of running processes as a Chrome/Perfetto trace.

    Every CUDA and NCCL call with its host timestamps, the Python stacks sampled (on and off CPU),
    off-CPU spans with their stacks, GC pauses, and what each CUDA stream was given: one track per
    rank thread and stream. Open the file at https://ui.perfetto.dev (or chrome://tracing).
    Needs root (or CAP_BPF + CAP_PERFMON).

    \b
    Examples:
      sudo argus record -p 4242 -d 10s -o trace.json
      sudo argus record -p 4242 -p 4243 -d 5s --python-hz 199 -o step.json
    """
    from argus.probes import libcuda, libcudart, libnccl

    if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
        raise UsageError("--ringbuf-pages must be a power of two", "e.g. 4096 (16 MiB)")
    for pid in pids:
        if not os.path.exists(f"/proc/{pid}"):
            raise NoSuchProcess(f"no process with pid {pid}", "check the pid: ps -eo pid,cmd | grep -i train")
    chosen = ((libcuda.CHANNEL, no_cuda), (libcudart.CHANNEL, no_cuda), (libnccl.CHANNEL, no_nccl))
    channels = [c for c, off in chosen if not off]
    aux_channels, py_opts, bpf_extra = pyopts.from_cli(aux, host_default=True)
    channels += aux_channels
    opts = bpfprog.BpfOptions(ringbuf_pages=ringbuf_pages, record=True, launch_latency=True, **bpf_extra)
    for pid in pids:
        inspect(pid, channels)
    return Recorder(channels, opts, py_opts, list(pids), duration, output).run()


class Recorder:
    def __init__(
        self,
        channels: List[Any],
        opts: bpfprog.BpfOptions,
        py_opts: Any,
        pids: List[int],
        duration: float,
        out: str,
    ) -> None:
        self.channels, self.opts, self.py_opts = channels, opts, py_opts
        self.pids, self.duration, self.out = pids, duration, out
        self.stop = False

    def run(self) -> int:
        t0 = time.monotonic()
        s = RecordSession(self.channels, self.opts, py_opts=self.py_opts)
        s.kept = []
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        ranks: Dict[int, int] = {}
        try:
            for pid in self.pids:
                ident = identity.of_pid(pid, None, None, None)
                s.add(pid, ident)
                ranks[pid] = ident.rank
            start_ns = time.monotonic_ns()
            click.echo(
                f"Recording {len(self.pids)} process(es) for {self.duration:g} s "
                f"(ready in {time.monotonic() - t0:.1f} s). Hit Ctrl-C to end early.",
                err=True,
            )
            resolved = 0
            end = time.monotonic() + self.duration
            try:
                while not self.stop and time.monotonic() < end:
                    time.sleep(0.05)
                    s.consume()
                    resolved = self._resolve(s, resolved)  # names while the processes are alive
                    if all(process_gone(p) for p in self.pids):
                        break
            except KeyboardInterrupt:
                pass
            s.consume()
            self._resolve(s, resolved)
            trace = self._build(s, ranks, start_ns)
        finally:
            s.close(background=True)
        problems = validate(trace)
        with open(self.out, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        n = len(trace["traceEvents"])
        click.echo(
            f"wrote {self.out}: {n} events, {len(s.kept)} records"
            + (f", {s.dropped} dropped (window too busy)" if s.dropped else "")
            + (f", drops in BPF: {s.health.drops}" if s.health.drops else ""),
            err=True,
        )
        if problems:
            click.echo(f"warning: trace check: {problems[0]} ({len(problems)} problem(s))", err=True)
        return 0

    def _resolve(self, s: RecordSession, done: int) -> int:
        py = s.py
        if py is None:
            return len(s.kept)
        for r in s.kept[done:]:
            t = py.targets.get(r.h.tgid)
            if t is None:
                continue
            if isinstance(r, (RecPySample, RecOffcpu)) and r.stack:
                py.frames(t, r.stack)
            if isinstance(r, RecOffcpu) and t.host is not None:
                py._native_folded(t, r.h.tid, r.ustack, r.kstack)
        return len(s.kept)

    def _build(self, s: RecordSession, ranks: Dict[int, int], start_ns: int) -> dict:
        py = s.py

        def frames(pid: int, stack: int) -> Optional[list]:
            t = py.targets.get(pid) if py is not None else None
            return t.frames.get(stack) if t is not None else None

        def phase(pid: int, stack: int) -> str:
            f = frames(pid, stack)
            return py.matcher.phase_of(f) if f and py is not None else OTHER

        def native(pid: int, tid: int, u: int, k: int) -> str:
            t = py.targets.get(pid) if py is not None else None
            return t.native.get((tid, u, k), "") if t is not None else ""

        def thread(pid: int, tid: int) -> str:
            t = py.targets.get(pid) if py is not None else None
            if t is not None:
                return py.thread_name(t, tid)
            return str(tid)

        def code(pid: int, c: int) -> str:
            t = py.targets.get(pid) if py is not None else None
            return py._code_name(t, c) if t is not None else f"code@{c:#x}"

        hz = self.py_opts.hz if self.py_opts is not None else 49
        names = Names(frames, phase, native, thread, code, ranks, int(1e9 / hz))
        tb = TraceBuilder(names, start_ns)
        tb.add(r for r in s.kept if r.h.ts >= start_ns or isinstance(r, RecFuncName))
        return tb.trace({"pids": self.pids, "duration_s": self.duration, "python_hz": hz})
