"""`argus probe`: attach to running training processes and report per-rank, per-step activity."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import click

from argus import gctune, redisconf
from argus.agent import attach, bpfprog, discover, identity, launchwin, privs, pyopts
from argus.agent import session as sess
from argus.agent.pyagent import PyOptions
from argus.agent.redisout import RedisOut
from argus.agent.render import RankView, render
from argus.agent.targets import process_gone
from argus.errors import ArgusError, NoSuchProcess, UsageError
from argus.gpu import compact as gpu_compact
from argus.probes import libcuda, libcudart, libnccl
from argus.probes.base import Channel
from argus.redisconf import RedisConf
from argus.schema import RankStep, to_probe_json

REWATCH_S = 60.0  # how long a pid that ran exec is watched for its new program to map the libraries
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(text: str) -> float:
    """'500ms', '10s', '2m', '1h' or a plain number of seconds."""
    m = _DURATION.match(text)
    if not m:
        raise click.BadParameter(f"'{text}' is not a duration (e.g. 500ms, 10s, 2m)")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]


class DurationType(click.ParamType):
    name = "DURATION"

    def convert(self, value: object, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(str(value))
        except click.BadParameter as e:
            self.fail(str(e.message), param, ctx)


@click.command("probe")
@click.option(
    "-p", "--pid", "pids", type=int, multiple=True, metavar="PID", help="Process to probe (repeatable)."
)
@click.option(
    "--all",
    "all_",
    is_flag=True,
    help="Probe every rank on this host (processes that map libcuda/libcudart/libnccl), new ones too.",
)
@click.option(
    "--match",
    metavar="REGEX",
    help="With --all: only processes whose command line, or an ancestor's, matches "
    "(torch.multiprocessing.spawn ranks run `python -c ...spawn_main...`; torchrun's ranks in a "
    "Slurm step are two levels under `slurmstepd: [JOB.STEP]`).",
)
@click.option(
    "--wait",
    is_flag=True,
    help="With --all: when no process matches yet, wait for one (a per-host service) instead of an error.",
)
@click.option(
    "-i",
    "--interval",
    type=DurationType(),
    default="1s",
    show_default=True,
    help="How often maps are drained and output is produced.",
)
@click.option(
    "-d",
    "--duration",
    type=DurationType(),
    default=None,
    help="Stop after this long (default: until Ctrl-C or every target exited).",
)
@click.option(
    "-j",
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per rank per step on stdout (fields: docs/probe.md).",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="Print no rank table (for services: off a terminal it is printed every interval); "
    "notices still go to stderr, --json still to stdout.",
)
@click.option(
    "--redis",
    "redis_url",
    metavar="URL",
    default=None,
    help="Also publish summaries and heartbeats to Redis: redis://HOST:PORT/DB, rediss://... (TLS), "
    "unix:///path or a cluster's seeds, redis+cluster://HOST:PORT,HOST:PORT. Credentials: "
    "ARGUS_REDIS_USERNAME, ARGUS_REDIS_PASSWORD or ARGUS_REDIS_PASSWORD_FILE "
    "(never in the URL). See docs/schema.md.",
)
@click.option(
    "--redis-buffer",
    type=int,
    default=10_000,
    show_default=True,
    help="Summaries kept in memory while Redis is down or slow (then the oldest are dropped, counted).",
)
@click.option(
    "--redis-maxlen",
    type=int,
    default=100_000,
    show_default=True,
    help="Approximate cap of the job's Redis step stream (XADD MAXLEN ~).",
)
@click.option(
    "--ebpf", is_flag=True, help="Print the BPF program and compiler flags, then exit (no root needed)."
)
@click.option(
    "--job",
    default=None,
    help="Job name (default: the launcher's job id, else MASTER_ADDR:MASTER_PORT, else the spawning "
    "parent's pid; see docs/probe.md).",
)
@click.option(
    "--rank",
    type=int,
    default=None,
    help="Rank of the single target (default: RANK etc. in its environment now, else its NCCL communicator).",
)
@click.option("--host", default=None, help="Host name to report (default: this host).")
@click.option(
    "--step-fn",
    default=None,
    metavar="[LIB_REGEX:]SYMBOL",
    help="End a step at every call of this native function instead of detecting steps.",
)
@click.option("--no-cuda", is_flag=True, help="Skip the CUDA channel (libcuda).")
@click.option("--no-cudart", is_flag=True, help="Skip the CUDA runtime channel (libcudart).")
@click.option("--no-nccl", is_flag=True, help="Skip the NCCL channel (libnccl).")
@click.option(
    "--launch-latency/--no-launch-latency",
    default=False,
    show_default=True,
    help="Also probe every launch's return: a histogram of cuLaunchKernel host time and launch "
    "errors (a uretprobe per launch, ~1 us more each; off by default for the overhead budget).",
)
@click.option(
    "--launch-steps",
    default="3/30",
    show_default=True,
    metavar="N/M|all",
    help="Probe kernel launches for N whole steps of every M: their uprobe is most of what probing "
    "costs. Steps outside say their launches were not sampled; a launch-bound job (launches waiting "
    "for a full launch queue) keeps the window open. 'all': every step.",
)
@click.option(
    "--ringbuf-pages",
    type=int,
    default=bpfprog.BpfOptions.ringbuf_pages,
    show_default=True,
    help="Ring buffer size in 4 KiB pages (raise it if records are dropped; the agent says so).",
)
@click.option(
    "--coll-records",
    type=int,
    default=bpfprog.BpfOptions.coll_records,
    show_default=True,
    metavar="N",
    help="Collective records per communicator and step at most: past it every n-th collective "
    "(the same ones on every rank) has a record, the rest are only counted in BPF. Counts, bytes "
    "and host time stay exact. 0: a record for every collective (costs the agent CPU at "
    "tensor-parallel rates).",
)
@pyopts.python_options
def probe_cmd(
    pids: Tuple[int, ...],
    all_: bool,
    match: Optional[str],
    wait: bool,
    interval: float,
    duration: Optional[float],
    as_json: bool,
    redis_url: Optional[str],
    redis_buffer: int,
    redis_maxlen: int,
    ebpf: bool,
    job: Optional[str],
    rank: Optional[int],
    host: Optional[str],
    step_fn: Optional[str],
    no_cuda: bool,
    no_cudart: bool,
    no_nccl: bool,
    launch_latency: bool,
    launch_steps: str,
    ringbuf_pages: int,
    coll_records: int,
    **aux: Any,
) -> int:
    """Trace CUDA and NCCL activity of running training processes, per rank and per step.

    Attaches eBPF uprobes to the libcuda.so.1 and libnccl.so.2 each process has mapped; nothing
    in the process changes and it is never restarted. Steps are found from the repeating pattern
    of host syncs and collectives. Needs root (the uprobe PMU asks for CAP_SYS_ADMIN).

    \b
    Examples:
      sudo argus probe -p 4242                     # live table for one rank
      sudo argus probe -p 4242 -p 4243 -d 30s --json > steps.jsonl
      sudo argus probe --all --match train.py      # every rank on this host
      sudo argus probe --all --wait --redis redis://10.0.0.5:6379/0   # a per-host service
      sudo argus probe -p 4242 --launch-steps all  # launch counts at every step (costs more)
      sudo ARGUS_REDIS_PASSWORD_FILE=/etc/argus/redis.pw argus probe --all --redis redis://10.0.0.5:6379/0
      argus probe --ebpf                           # show the BPF program, no root
    """
    chosen = ((libcuda.CHANNEL, no_cuda), (libcudart.CHANNEL, no_cudart), (libnccl.CHANNEL, no_nccl))
    channels = [c for c, off in chosen if not off]
    aux_channels, py_opts, bpf_extra = pyopts.from_cli(aux)  # Python, host (argus/agent/pyopts.py)
    if not channels and not py_opts.python:
        raise UsageError("--no-cuda, --no-cudart and --no-nccl leave nothing to probe", "drop one of them")
    channels += aux_channels
    try:
        window = launchwin.parse(launch_steps)
    except ValueError as e:
        raise UsageError(f"--launch-steps {e}", "e.g. --launch-steps 3/30, or all") from None
    opts = bpfprog.BpfOptions(
        launch_latency=launch_latency,
        # launches that waited for a full queue: their returns probed in the launch windows only
        # (a launch-bound job keeps the window open: argus/agent/launchwin.py)
        launch_wait=window is not None,
        ringbuf_pages=ringbuf_pages,
        coll_records=coll_records,
        **bpf_extra,
    )
    if ebpf:
        click.echo(bpfprog.full_text(channels))
        click.echo(f"/* cflags: {' '.join(bpfprog.cflags(channels, opts))} */")
        return 0
    if not pids and not all_:
        raise UsageError(
            "nothing to probe: give -p PID (repeatable) or --all",
            "e.g. sudo argus probe -p $(pgrep -f train.py | head -1)",
        )
    if pids and all_:
        raise UsageError("give either -p or --all, not both", "-p PID for given processes, --all for all")
    if (match or wait) and not all_:
        raise UsageError("--match and --wait go with --all", "e.g. sudo argus probe --all --match train.py")
    if match:
        try:
            re.compile(match)
        except re.error as e:
            raise UsageError(
                f"--match {match!r} is not a regular expression ({e})", "e.g. --match 'train\\.py'"
            ) from None
    if rank is not None and len(pids) != 1:
        raise UsageError("--rank applies to exactly one -p PID", "ranks come from each process's RANK")
    if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
        raise UsageError("--ringbuf-pages must be a power of two", "e.g. 256 (1 MiB) or 1024")
    if coll_records < 0:
        raise UsageError("--coll-records must be >= 0", "e.g. --coll-records 64, or 0 for every collective")
    for pid in pids:
        if not os.path.exists(f"/proc/{pid}"):
            raise NoSuchProcess(f"no process with pid {pid}", "check the pid: ps -eo pid,cmd | grep -i train")
    conf = None
    if redis_url:
        if redis_buffer < 1 or redis_maxlen < 1:
            raise UsageError("--redis-buffer and --redis-maxlen must be >= 1", "e.g. --redis-buffer 1000")
        conf = redisconf.parse(redis_url)  # a malformed URL is a usage error, before anything starts
        for w in conf.warnings:
            click.echo(f"warning: {w}", err=True)
    options = ProbeOptions(
        channels=tuple(channels),
        bpf=opts,
        py=py_opts,
        pids=tuple(pids),
        all=all_,
        match=match,
        wait=wait,
        interval=interval,
        duration=duration,
        as_json=as_json,
        quiet=bool(aux.get("quiet")),
        job=job,
        rank=rank,
        host=host,
        step_fn=step_fn,
        launch_window=window,
        gpu_metrics=not aux.get("no_gpu_metrics"),
        redis=conf,
        redis_buffer=redis_buffer,
        redis_maxlen=redis_maxlen,
    )
    return Prober(options).run()


@dataclass(frozen=True)
class ProbeOptions:
    """What `argus probe` was asked to do, checked by the click command: the Prober's one input."""

    channels: Tuple[Channel, ...]
    bpf: bpfprog.BpfOptions = field(default_factory=bpfprog.BpfOptions)
    py: Optional[PyOptions] = None  # the Python and host channels (None: neither)
    pids: Tuple[int, ...] = ()
    all: bool = False  # --all: every rank on this host, new ones too
    match: Optional[str] = None  # --all --match REGEX
    wait: bool = False  # --all --wait: no match yet is no error
    interval: float = 1.0  # s between drains and output
    duration: Optional[float] = None  # s; None: until Ctrl-C or every target exited
    as_json: bool = False
    quiet: bool = False  # no rank table
    job: Optional[str] = None
    rank: Optional[int] = None  # --rank of the single -p target
    host: Optional[str] = None
    step_fn: Optional[str] = None  # --step-fn [LIB:]SYMBOL
    launch_window: Optional[Tuple[int, int]] = None  # --launch-steps N/M (argus/agent/launchwin.py)
    gpu_metrics: bool = True  # NVML channel (argus/gpu.py)
    redis: Optional[RedisConf] = None  # --redis, parsed
    redis_buffer: int = 10_000
    redis_maxlen: int = 100_000


class Prober:
    """The agent's main loop around a Session (kept out of the click function for readability)."""

    def __init__(self, options: ProbeOptions) -> None:
        o = self.o = options
        self.redis: Optional[RedisOut] = None
        if o.redis is not None:
            self.redis = RedisOut(o.redis, o.host, self._say, o.redis_buffer, o.redis_maxlen)
        self.gpu: Optional[Any] = None
        self._drops_said, self._drops_next = 0, 0.0  # records lost in BPF already warned about
        self.stop = False
        self.views: Dict[int, RankView] = {}
        self.passed: Set[int] = set()  # --all: launchers and helpers already said to be no rank
        self.rewatch: Dict[int, float] = {}  # pid that ran exec -> until when to wait for its libraries

    @property
    def _python(self) -> bool:
        return bool(self.o.py is not None and self.o.py.python)

    def _discover(self) -> List[int]:
        """--all: the ranks on this host now; says once why a matched process is not one."""
        found = discover.candidates(self.o.match, self._python)
        for pid in found.launchers:
            if pid not in self.passed:
                self.passed.add(pid)
                self._say(
                    f"pid {pid}: a launcher of ranks, not a rank ({identity.cmdline(pid)[:60]}): not traced"
                )
        for pid, of in found.helpers.items():
            if pid not in self.passed:
                self.passed.add(pid)
                self._say(f"pid {pid}: a helper of pid {of} (same rank, forked from it): not traced")
        return found.pids

    def _none_found(self) -> NoSuchProcess:
        what = f"matches {self.o.match!r}" if self.o.match else "maps libcuda, libcudart or libnccl"
        return NoSuchProcess(
            f"no process on this host {what} (its command line or its parent's)",
            discover.suggestions(discover.scan(), os.getpid()) + "; --wait waits for one, -p PID names one",
        )

    def _say(self, msg: str) -> None:
        click.echo(msg, err=True)

    def _add(self, session: sess.Session, pid: int, explicit: bool) -> bool:
        try:
            ident = identity.of_pid(pid, self.o.job, self.o.rank, self.o.host)
            t = session.add(pid, ident)
        except ArgusError:
            if explicit:
                raise
            return False
        self.views[pid] = RankView(pid, ident.rank, ident.host)
        if self.o.rank is not None:  # the flag wins; say so when the process says otherwise
            own = identity.of_pid(pid, self.o.job, None, self.o.host)
            if 0 <= own.rank != self.o.rank:
                why = f"rank {own.rank} from {own.rank_why}"
                self._say(f"warning: pid {pid}: --rank {self.o.rank} overrides {why}")
        libs = ", ".join(f"{lp.library.path}" for lp in t.libraries.values())
        self._say(
            f"pid {pid}: rank {ident.rank if ident.rank >= 0 else '?'} of job {ident.job} on {ident.host} "
            f"({ident.describe()}) [{libs}]"
        )
        if "nccl" in t.libraries:
            self._say(f"pid {pid}: communicators identified from {t.layout.source}: {t.layout.note}")
        return True

    def run(self) -> int:
        o = self.o
        for pid in o.pids:  # fail before compiling when a pid is not a target
            attach.inspect(pid, o.channels)
        if o.all and not o.wait and not discover.candidates(o.match, self._python).pids:
            raise self._none_found()
        t0 = time.monotonic()
        s = sess.Session(o.channels, o.bpf, o.step_fn, py_opts=o.py, launch_window=o.launch_window)
        if o.gpu_metrics:
            from argus.gpu import GpuMetrics

            gpu = GpuMetrics(say=self._say)  # no NVML: one note, and the channel stays off
            self.gpu = gpu if gpu.available else None
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        try:
            for pid in o.pids:
                self._add(s, pid, explicit=True)
            if o.all:
                for pid in self._discover():
                    self._add(s, pid, explicit=False)
            chans = "+".join(c.name for c in o.channels)
            self._say(
                f"Tracing {len(s.targets)} process(es) ({chans}, {s.health.attached} probes, ready in "
                f"{time.monotonic() - t0:.1f} s). Hit Ctrl-C to end."
            )
            for lib, (behind, total, slow) in s.health.stubs.items():
                self._say(
                    f"{lib}: {behind} of {total} functions probed at the implementation behind their "
                    f"exported dispatch stub ({slow} single-stepped)"
                )
            for p in s.health.slow_probes:
                self._say(
                    f"warning: {p.library}:{p.symbol} starts with an instruction the kernel must single-step "
                    f"({p.insn}): ~13 µs per call instead of ~1 µs"
                )
            for w in s.health.warnings:
                self._say(f"warning: {w}")
            self._drop_capabilities()  # before any thread of ours starts: capabilities are per thread
            if self.redis is not None:
                self.redis.start()  # unreachable Redis: a warning from its thread, and retries
            gctune.tune_gc()
            gctune.freeze_startup()
            # Ctrl-C (or a supervisor's SIGINT) while tracing asks the loop to stop, as SIGTERM does:
            # a KeyboardInterrupt raised inside a drain lost the steps it had cut and re-cut their
            # epochs as empty steps (4 of 45 recorded runs); a second Ctrl-C still interrupts
            signal.signal(signal.SIGINT, self._on_sigint)
            return self._loop(s)
        except KeyboardInterrupt:
            return 0
        finally:
            self._finish(s)

    def _on_sigint(self, *_: object) -> None:
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True

    def _drop_capabilities(self) -> None:
        """Keep only what attaching to ranks found later needs (argus/agent/privs.py)."""
        host = bool(self.o.py is not None and self.o.py.host)  # kernel stacks to name
        d = privs.drop_capabilities(privs.kept(kernel_stacks=host))
        self._say(d.describe())
        if d.error is None:
            for tid in privs.threads_above(d.after):
                self._say(f"warning: thread {tid} started before the drop keeps its capabilities")

    def _loop(self, s: sess.Session) -> int:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=False)
        live = None
        o = self.o
        if not o.as_json and not o.quiet and console.is_terminal:
            live = Live(console=console, refresh_per_second=2, transient=False)
            live.start()
        start = time.monotonic()
        next_drain = start + o.interval
        next_scan = start + 2.0
        try:
            while not self.stop:
                time.sleep(0.05)
                s.consume()
                s.poll_windows()  # --launch-steps: attach or detach the launch probes on time
                if self.redis is not None:
                    self.redis.tick(s)  # a heartbeat every 2 s, steps or not (a hung job has none)
                now = time.monotonic()
                if now < next_drain:
                    continue
                next_drain = now + o.interval
                self._emit(s, live)
                if now >= next_scan:
                    next_scan = now + 2.0
                    for pid in s.execed():
                        self._execed(s, pid)
                    self._rewatch(s)
                    for pid in self._discover() if o.all else ():
                        if pid not in s.targets:
                            self._add(s, pid, explicit=False)
                    s.reread_identities(o.job, o.host)  # a script may set RANK after we attached
                if o.duration is not None and now - start >= o.duration:
                    break
                if not o.all and not self.rewatch and all(not t.alive for t in s.targets.values()):
                    break
        finally:
            if live is not None:
                live.stop()
        return 0

    def _execed(self, s: sess.Session, pid: int) -> None:
        """The pid runs a new program: its old image's steps are flushed, then it is a new target."""
        s.remove(pid)
        self._output(s.rank_steps())  # the old image's tail
        s.forget(pid)
        self.views.pop(pid, None)
        self._say(f"pid {pid} ran exec ({identity.cmdline(pid)[:60]}): tracing it as a new program")
        if not self._add(s, pid, explicit=False):  # not mapped yet (still importing), or never
            self.rewatch[pid] = time.monotonic() + REWATCH_S
            self._say(f"pid {pid}: its new program maps no libcuda/libcudart/libnccl yet: watching it")

    def _rewatch(self, s: sess.Session) -> None:
        now = time.monotonic()
        for pid, until in list(self.rewatch.items()):
            if pid in s.targets or self._add(s, pid, explicit=False):  # (--all may have found it)
                del self.rewatch[pid]
            elif now > until or process_gone(pid):
                del self.rewatch[pid]
                self._say(f"pid {pid}: its new program never mapped libcuda/libcudart/libnccl: not traced")

    DROP_WARN_EVERY_S = 30.0

    def _warn_drops(self, s: sess.Session) -> None:
        """Records lost in BPF, said when it happens (at most every 30 s), not only at exit: the
        steps they fell in are short by them, and at high collective rates a ring too small for the
        burst between two drains can hide every step boundary."""
        total = sum(s.health.drops.values())
        said = self._drops_said
        now = time.monotonic()
        if total <= said or now < self._drops_next:
            return
        self._drops_said, self._drops_next = total, now + self.DROP_WARN_EVERY_S
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(s.health.drops.items()))
        self._say(
            f"WARNING: {total - said:,} records lost in BPF since the last warning ({kinds} in all): the "
            f"steps they fell in are incomplete (each summary's `drops` says which); raise "
            f"--ringbuf-pages (now {s.opts.ringbuf_pages})"
        )

    def _emit(self, s: sess.Session, live: Optional[object]) -> None:
        gone = s.exited()
        if gone and self.redis is not None:
            # one more heartbeat while they are still known: where each rank got to (its last
            # collective per communicator) stays on record after it exits, even for a short job
            s.consume()
            self.redis.tick(s, force=True)
        reaped = s.reap(gone)
        for pid in reaped:
            v = self.views.get(pid)
            if v is not None:
                v.exited = True
        if reaped:  # one line per batch: ranks of a job end together
            left = sum(t.alive for t in s.targets.values())
            who = ", ".join(str(p) for p in reaped)
            rest = f"still tracing {left} process(es)" if left else "no process left to trace"
            self._say(f"pid{'s' if len(reaped) > 1 else ''} {who} exited; {rest}")
        s.consume()
        s.drain()
        self._warn_drops(s)
        if self.gpu is not None:
            self.gpu.sample()
        steps = s.rank_steps()
        for t, old in s.take_identity_changes():
            new = t.identity
            v = self.views.get(t.pid)
            if v is not None:
                v.rank = new.rank
            was = f"rank {old.rank}" if old.rank >= 0 else "rank ?"
            self._say(
                f"pid {t.pid}: rank {new.rank} of job {new.job} ({was} before; rank from {new.rank_why})"
            )
        self._output(steps)
        if self.o.as_json or self.o.quiet:
            return
        header = f"argus probe — {len(self.views)} process(es) — interval {self.o.interval:g} s"
        footer = [self.redis.footer()] if self.redis is not None else []
        table = render(list(self.views.values()), s.health.drops, header, len(s.health.slow_probes), footer)
        if live is not None:
            live.update(table)  # type: ignore[attr-defined]
        else:
            from rich.console import Console

            Console(width=200).print(table)

    def _output(self, steps: List[RankStep]) -> None:
        for rs in steps:
            if self.gpu is not None:
                g = self.gpu.for_pid(rs.pid)
                if g is not None:
                    rs.gpu = gpu_compact(g)
                    if rs.detail is not None:
                        rs.detail.gpu = g  # --json prints the whole sample
            v = self.views.get(rs.pid)
            if v is not None:
                v.update(rs)
            if self.o.as_json:
                sys.stdout.write(json.dumps(to_probe_json(rs), separators=(",", ":")) + "\n")
        sys.stdout.flush()
        if self.redis is not None:
            self.redis.steps(steps)

    def _finish(self, s: sess.Session) -> None:
        # the last steps and the Redis flush: a Ctrl-C (or the SIGINT of a supervisor stopping an
        # agent that is already ending on its own) must not cut them short into "Aborted."
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            s.consume()
            if self.redis is not None:
                self.redis.tick(s, force=True)  # the last heartbeat, while the targets are still known
            for pid in list(s.targets):
                s.remove(pid)
            s.drain()
            self._output(s.rank_steps())
            if s.health.drops:
                self._say(f"dropped records: {s.health.drops} — raise --ringbuf-pages or lower --interval")
            lo = s.health.left_out
            if lo["launches"] or lo["collectives"]:
                self._say(
                    f"in no step: {lo['launches']:,} kernel launches and {lo['collectives']:,} collectives "
                    f"of {lo['epochs']:,} sync interval(s) before each process's first step boundary "
                    "(the step it was attached in the middle of)"
                )
            if self.redis is not None:
                self._say(self.redis.close())
        finally:
            s.close(background=True)
