"""Aggregator scale: synthetic summaries (argus.replay.synthetic_steps) for 1,024 and 10,000 ranks.

    .venv/bin/python -m benchmarks.aggregator_scale [--ranks 1024,10000] [--steps 24] [--no-redis]

1. Engine alone, one core: rank-steps/s of `Engine.add` (CPU time), the step at which the injected
   straggler (rank N/3, 1.3x compute from the middle step) is named, and the process's peak RSS.
2. Through Redis (a private redis-server): summaries published (msgpack, argus.wire), then read by
   `argus.aggregator.service.Aggregator` processes through one consumer group — decode, alignment,
   every level — one aggregator, then two sharing the group: entries each took, CPU seconds,
   rank-steps/s per core.
3. Live at 1 step/s: the publisher paces N summaries per second while one aggregator consumes; the
   detection latency is the wall time from publishing the straggler's first slow step to its alert.
4. Soak (issue 14, item 5), `--soak SECONDS [--soak-ranks 10000] [--step-s 2.0]`: the real
   `argus aggregate --job JOB` as a subprocess, as users run it, while this process publishes a
   synthetic job's summaries at one job step every `--step-s` seconds for the whole duration, with
   one 1.3x straggler from 50% to 65% of the run (its alert must fire, and resolve, late in the run).
   Every 10 s: the aggregator's RSS and CPU, the consumer group's lag and pending entries
   (XINFO GROUPS), Redis used_memory; then a verdict: RSS growth after warm-up, the largest lag,
   the alerts, and the last minute against the first. Exits 1 if the aggregator died.
   Why one step every 2 s: a 10,000-GPU job's step is seconds long, one aggregator on one core
   sustains ~9,400 rank-steps/s through Redis (2. above; ~6,600 per CPU-second in the soak, the
   other core busy), and on this 2-core box the publisher needs the other core; 10,000 ranks / 2 s
   = 5,000 summaries/s.

    .venv/bin/python -m benchmarks.aggregator_scale --soak 600 [--soak-ranks 10000] [--step-s 2.0]

5. One job over several aggregators (issue 16, item 0), `--sharded`: the same replay judged by one
   aggregator, then by `--shards` members (`argus.aggregator.sharded.Member`, one process each):
   alerts compared, CPU by role (route, shard, reduce, plan), Redis CPU per summary, peak RSS;
   every member reading the whole stream instead of routing, timed on the same stream; the CPU
   a 100,000-rank job at one step a second needs, and so N; then live, the real `argus aggregate`
   (baseline), `--shard 0/1` and N x `--shard I/N` at `--shard-live-ranks` summaries a second.

    .venv/bin/python -m benchmarks.aggregator_scale --sharded [--shards 2] [--shard-ranks 1024]
        [--shard-scale 16384] [--shard-scale-steps 8] [--shard-live-ranks 2048] [--shard-live-s 40]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from argus.aggregator.engine import Engine  # noqa: E402
from argus.replay import Straggler, synthetic_steps  # noqa: E402

FACTOR = 1.3


def _straggler(n: int, steps: int) -> Straggler:
    return Straggler(rank=n // 3, factor=FACTOR, from_step=steps // 2)


def engine_only(n: int, steps: int) -> Dict[str, Any]:
    from argus.gctune import tune_gc

    tune_gc()  # as `argus aggregate` does
    eng = Engine()
    cpu = 0.0
    named: Optional[int] = None
    count = 0
    for rs in synthetic_steps("scale", n, steps, straggler=_straggler(n, steps), seed=1):
        t0 = time.process_time()
        out = eng.add(rs)
        cpu += time.process_time() - t0
        count += 1
        for a in out:
            if a.state == "firing" and a.kind == "straggler" and named is None:
                named = eng.jobs["scale"].last_step
    t0 = time.process_time()
    eng.flush()
    cpu += time.process_time() - t0
    return {
        "ranks": n,
        "steps": steps,
        "rank_steps": count,
        "cpu_s": cpu,
        "rate": count / cpu,
        "onset": steps // 2,
        "named_at": named,
        "alerts": [(a.kind, a.ranks[:3]) for a in eng.alerts()],
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---- Redis --------------------------------------------------------------------------------------------


def start_redis() -> tuple:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("no redis-server (apt-get install redis-server), or run with --no-redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="argus-scale-redis-")
    p = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", d],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    c = redis.Redis(port=port)
    for _ in range(100):
        try:
            c.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return p, f"redis://127.0.0.1:{port}/0"


def aggregate_child(
    url: str, job: str, total: int, consumer: str, idle_s: float, lease: bool = True
) -> Dict[str, Any]:
    """One aggregator process: consume until `total` entries were taken by the group (or idle).
    `lease` False: no leadership (alone on the job; a poll judging a 100,000-rank step outlasts the
    10 s lease, and a leader that lost it would stand by)."""
    from argus import redisconf
    from argus.aggregator.service import Aggregator
    from argus.gctune import tune_gc

    tune_gc()  # as `argus aggregate` does
    client = redisconf.parse(url).client(timeout_s=10)
    agg = Aggregator(client, Engine(), [job], consumer=consumer, count=1024, lease_s=10.0 if lease else None)
    first: Optional[float] = None
    named: Optional[float] = None
    last_data = time.monotonic()
    while True:
        n = agg.poll(block_ms=100)
        now = time.monotonic()
        if n:
            last_data = now
            first = first or now
        if named is None and any(a.kind == "straggler" for a in agg.engine.book.firing()):
            named = time.time()
        if now - last_data > idle_s:
            break
    return {
        "consumer": consumer,
        "entries": agg.stats.entries,
        "cpu_s": agg.stats.cpu_s,
        "wall_s": last_data - (first or last_data),
        "named_at_unix": named,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "hwm_mb": _hwm_mb(),
    }


def _spawn(args: List[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.aggregator_scale", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(REPO),
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def through_redis(url: str, n: int, steps: int, consumers: int) -> List[Dict[str, Any]]:
    from argus import redisconf
    from argus.replay import publish_all

    client = redisconf.parse(url).client(timeout_s=30)
    job = f"scale-{n}-{consumers}"
    client.delete(f"argus:{{{job}}}:steps")
    items = synthetic_steps(job, n, steps, straggler=_straggler(n, steps), seed=2)
    publish_all(client, items, maxlen=n * steps + 1000)
    procs = [_spawn(["--child", url, job, str(n * steps), f"c{i}", "3"]) for i in range(consumers)]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]


def live(url: str, n: int, steps: int) -> Dict[str, Any]:
    """Publisher paced at one step per second; one aggregator consumes as it goes."""
    from argus import redisconf
    from argus.replay import publish_all

    client = redisconf.parse(url).client(timeout_s=30)
    job = f"live-{n}"
    proc = _spawn(["--child", url, job, str(n * steps), "live", "5"])
    time.sleep(1.0)
    onset = steps // 2
    marks: Dict[int, float] = {}

    def paced() -> Any:
        for rs in synthetic_steps(
            job, n, steps, straggler=_straggler(n, steps), seed=3, start_ns=time.time_ns()
        ):
            if rs.rank == 0:
                marks[rs.step or 0] = time.time()
            yield rs

    publish_all(client, paced(), rate=float(n), maxlen=n * steps + 1000)
    res = json.loads(proc.communicate()[0].strip().splitlines()[-1])
    t_onset = marks.get(onset)
    res["latency_s"] = (res["named_at_unix"] - t_onset) if res.get("named_at_unix") and t_onset else None
    return res


# ---- soak: the real `argus aggregate` for minutes -----------------------------------------------------

SOAK_STRAGGLER = (0.50, 0.65)  # the straggler is slow over this share of the run's steps


@dataclass
class Sample:
    t_s: float  # since publishing began
    step: int  # the last job step published in full
    rss_mb: float
    cpu_pct: float  # of one core, since the previous sample
    lag: int  # entries not yet delivered to the group
    pending: int  # delivered, not yet acknowledged
    redis_mb: float
    box_pct: float  # every core of the machine busy, since the previous sample (others' work too)

    def lag_s(self, ranks: int, step_s: float) -> float:
        """The lag in seconds of job time: entries / ranks = job steps behind."""
        return self.lag / ranks * step_s


@dataclass
class SoakAlert:
    state: str  # firing | resolved
    kind: str
    ranks: List[int]
    steps: List[int]
    t_s: float  # when the aggregator wrote the transition, since publishing began


@dataclass
class SoakResult:
    ranks: int
    step_s: float
    duration_s: float
    steps: int
    straggler: Straggler
    samples: List[Sample] = field(default_factory=list)
    alerts: List[SoakAlert] = field(default_factory=list)
    alive: bool = True  # the aggregator ran until it was stopped
    drained_s: Optional[float] = None  # after the last publish until lag and pending were 0
    published: int = 0
    final_line: str = ""  # the aggregator's own summary at exit
    output: List[str] = field(default_factory=list)  # everything it printed

    def at(self, share: float) -> Sample:
        """The first sample at or after `share` of the run (the last one if none)."""
        return next((x for x in self.samples if x.t_s >= share * self.duration_s), self.samples[-1])

    def transitions(self, state: str, kind: str, rank: Optional[int] = None) -> List[SoakAlert]:
        return [
            a
            for a in self.alerts
            if a.state == state and a.kind == kind and (rank is None or rank in a.ranks)
        ]

    def fired(self, kind: str, rank: Optional[int] = None) -> List[SoakAlert]:
        return self.transitions("firing", kind, rank)

    def resolved(self, kind: str, rank: Optional[int] = None) -> List[SoakAlert]:
        return self.transitions("resolved", kind, rank)


def _proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _proc_cpu_s(pid: int) -> float:
    # fields after the ")" of comm: utime and stime are the 14th and 15th of the whole line
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _box_busy() -> Tuple[float, float]:
    """(busy, total) jiffies of every core since boot: others' work shows in the ratio."""
    xs = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = xs[3] + xs[4]  # idle + iowait
    total = sum(xs[:8])  # guest time is already in user
    return total - idle, total


def group_lag(client: Any, job: str, group: str = "argus-aggregate") -> Tuple[int, int]:
    """(lag, pending) of the job's consumer group: Redis >= 7 reports `lag`; where it cannot (or
    an older server), entries added to the stream minus the group's entries read."""
    from argus.rediskeys import k_steps

    key = k_steps(job)
    for g in client.xinfo_groups(key):
        name = g.get("name")
        if (name.decode() if isinstance(name, bytes) else name) != group:
            continue
        lag = g.get("lag")
        if lag is None:
            added = int(client.xinfo_stream(key).get("entries-added") or client.xlen(key))
            lag = added - int(g.get("entries-read") or 0)
        return int(lag), int(g.get("pending") or 0)
    return client.xlen(key), 0  # no group yet: nothing read


def capacity(url: str, ranks: int = 10_000, steps: int = 4, job: str = "capacity") -> float:
    """Summaries a second one `argus aggregate` reads, decodes and judges on this machine now:
    `steps` job steps of `ranks` summaries are published first, at no pace, then the aggregator is
    started and timed from its first read to the backlog read and acknowledged. The soak's test
    paces well below this (live, beside the publisher, it reads 72-86% of it): what it holds the
    aggregator to (lag bounded, memory flat) holds only under its capacity, and a shared 2-core
    VM's varies 2x from day to day (2,900-5,600 a second)."""
    from argus import redisconf
    from argus.rediskeys import k_alert_state, k_alerts, k_leader, k_steps
    from argus.replay import publish_all

    client = redisconf.parse(url).client(timeout_s=30)
    client.delete(k_steps(job), k_alerts(job), k_alert_state(job), k_leader(job))
    start = time.time_ns() - int(steps * 2.5e9)
    backlog = synthetic_steps(job, ranks, steps, seed=5, step_ms=2500, start_ns=start)
    total = publish_all(client, backlog).entries
    proc = subprocess.Popen(
        [sys.executable, "-m", "argus", "aggregate", "--redis", url, "--job", job, "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=str(REPO),
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    try:
        first: Optional[Tuple[float, int]] = None
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline and proc.poll() is None:
            lag, pending = group_lag(client, job)  # (xlen, 0) until its group exists
            now = time.monotonic()
            if first is None and lag < total:
                first = (now, lag + pending)  # its first batch is read: start-up is not throughput
            elif first is not None and lag == 0 and pending == 0:
                return first[1] / max(now - first[0], 1e-3)
            time.sleep(0.05)
        raise RuntimeError(f"the aggregator did not read a backlog of {total:,} summaries in 120 s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        client.delete(k_steps(job), k_alerts(job), k_alert_state(job), k_leader(job))


def soak(
    url: str,
    ranks: int = 10_000,
    duration_s: float = 600.0,
    step_s: float = 2.0,
    sample_s: float = 10.0,
    job: str = "soak",
    say: Callable[[str], None] = print,
    drain_s: float = 60.0,
) -> SoakResult:
    """Run `argus aggregate` on `job` while publishing `ranks` summaries every `step_s` seconds
    for `duration_s`; sample it every `sample_s` (a markdown row each, through `say`)."""
    from argus import redisconf
    from argus.aggregator.service import history
    from argus.rediskeys import k_alert_state, k_alerts, k_leader, k_steps
    from argus.replay import publish_all

    steps = max(1, int(duration_s / step_s))
    lo, hi = SOAK_STRAGGLER
    st = Straggler(rank=ranks // 3, factor=FACTOR, from_step=int(steps * lo), to_step=int(steps * hi))
    res = SoakResult(ranks, step_s, duration_s, steps, st)
    client = redisconf.parse(url).client(timeout_s=30)
    # a fresh job: no backlog, no alert book, and no earlier aggregator's lease to wait out
    client.delete(k_steps(job), k_alerts(job), k_alert_state(job), k_leader(job))
    proc = subprocess.Popen(
        [sys.executable, "-m", "argus", "aggregate", "--redis", url, "--job", job],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(REPO),
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    started = threading.Event()

    def collect() -> None:
        for line in iter(proc.stdout.readline, ""):  # type: ignore[union-attr]
            res.output.append(line.rstrip("\n"))
            started.set()

    threading.Thread(target=collect, daemon=True).start()
    started.wait(30.0)  # its "Aggregating ..." line: the group exists, it reads from the start
    done_step = {"n": -1}
    stop = threading.Event()
    errors: List[BaseException] = []

    def paced() -> Any:
        prev = -1
        for rs in synthetic_steps(
            job, ranks, steps, straggler=st, seed=5, step_ms=step_s * 1000, start_ns=time.time_ns()
        ):
            if rs.step != prev:
                done_step["n"], prev = prev, rs.step or 0  # the previous step is all published
            if stop.is_set():
                return
            yield rs

    def publish() -> None:
        try:
            stats = publish_all(client_pub, paced(), rate=ranks / step_s)
            res.published = stats.entries
            done_step["n"] = steps - 1
        except BaseException as e:  # said by the main thread
            errors.append(e)

    client_pub = redisconf.parse(url).client(timeout_s=30)
    t0 = time.monotonic()
    t0_ms = time.time() * 1000
    pub = threading.Thread(target=publish, name="publisher", daemon=True)
    pub.start()
    say(
        f"soak: {ranks:,} ranks, one step every {step_s:g} s ({ranks / step_s:,.0f} summaries/s) for "
        f"{duration_s:g} s = {steps} steps; straggler rank {st.rank} {st.factor:g}x in steps "
        f"{st.from_step}-{(st.to_step or steps) - 1}; aggregator pid {proc.pid}\n"
    )
    say(
        "| elapsed s | job step published | RSS MB | lag entries | lag s (job time) | pending | "
        "aggregator CPU % of a core | Redis MB | machine busy % (all cores) |"
    )
    say("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    cpu_prev, t_prev, box_prev = _proc_cpu_s(proc.pid), time.monotonic(), _box_busy()

    def sample() -> Optional[Sample]:
        nonlocal cpu_prev, t_prev, box_prev
        if proc.poll() is not None:
            return None
        try:
            rss, cpu = _proc_rss_mb(proc.pid), _proc_cpu_s(proc.pid)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return None  # it exited between the poll and the read
        now = time.monotonic()
        lag, pending = group_lag(client, job)
        redis_mb = int(client.info("memory")["used_memory"]) / 2**20
        box = _box_busy()
        x = Sample(
            now - t0,
            done_step["n"],
            rss,
            100 * (cpu - cpu_prev) / max(now - t_prev, 1e-9),
            lag,
            pending,
            redis_mb,
            100 * (box[0] - box_prev[0]) / max(box[1] - box_prev[1], 1),
        )
        cpu_prev, t_prev, box_prev = cpu, now, box
        res.samples.append(x)
        say(
            f"| {x.t_s:.0f} | {x.step} | {x.rss_mb:.0f} | {x.lag:,} | {x.lag_s(ranks, step_s):.2f} | "
            f"{x.pending:,} | {x.cpu_pct:.0f} | {x.redis_mb:.0f} | {x.box_pct:.0f} |"
        )
        return x

    try:
        nxt = t0 + sample_s
        while pub.is_alive():
            pub.join(timeout=max(0.0, nxt - time.monotonic()))
            if time.monotonic() >= nxt:
                nxt += sample_s
                if sample() is None:
                    res.alive = False
                    break
        if errors:
            raise errors[0]
        # published in full: how long until the aggregator has read and acknowledged everything
        t_end = time.monotonic()
        while res.alive and time.monotonic() - t_end < drain_s:
            if proc.poll() is not None:
                res.alive = False
                break
            lag, pending = group_lag(client, job)
            if lag == 0 and pending == 0:
                res.drained_s = time.monotonic() - t_end
                break
            time.sleep(0.2)
        # a last sample after the drain (unless one was just taken: its CPU % would be noise)
        if res.alive and time.monotonic() - t_prev >= 2.0 and sample() is None:
            res.alive = False
    finally:
        stop.set()
        pub.join(timeout=30)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        else:
            res.alive = False
        time.sleep(0.2)  # the collector's last lines
    res.final_line = next((x for x in reversed(res.output) if " summaries, " in x), "")
    for eid, a in history(client, job):
        ms = int(eid.decode().split("-")[0])
        res.alerts.append(SoakAlert(a.state, a.kind, list(a.ranks), list(a.steps), (ms - t0_ms) / 1000))
    client.delete(k_steps(job))  # up to STEPS_MAXLEN entries of a shared server
    return res


def soak_verdict(r: SoakResult) -> List[str]:
    """The lines under the table: memory after warm-up, lag, alerts, last minute vs first."""
    out = ["", "verdict:", ""]
    if not r.samples:
        return [*out, "- no sample: the aggregator died before the first"]
    warm, end = r.at(0.2), r.samples[-1]
    grow = end.rss_mb - warm.rss_mb
    worst = max(r.samples, key=lambda x: x.lag)
    out.append(
        f"- aggregator {'ran to the end' if r.alive else 'DIED'}; {r.published:,} summaries published; "
        + (f"drained {r.drained_s:.1f} s after the last" if r.drained_s is not None else "NOT drained")
    )
    out.append(
        f"- RSS {warm.rss_mb:.0f} MB at {warm.t_s:.0f} s (20% of the run) -> {end.rss_mb:.0f} MB at "
        f"{end.t_s:.0f} s: {grow:+.0f} MB ({100 * grow / warm.rss_mb:+.1f}%); "
        f"peak {max(x.rss_mb for x in r.samples):.0f} MB"
    )
    out.append(
        f"- lag: max {worst.lag:,} entries = {worst.lag_s(r.ranks, r.step_s):.2f} s of job time "
        f"(at {worst.t_s:.0f} s); max pending {max(x.pending for x in r.samples):,}"
    )
    for a in r.alerts:
        out.append(
            f"- {a.state} {a.kind} ranks {a.ranks[:5]}{'...' if len(a.ranks) > 5 else ''} steps "
            f"{a.steps[0]}-{a.steps[1]} at {a.t_s:.0f} s"
        )
    if not r.alerts:
        out.append("- no alert transition")
    st = r.straggler
    f, rs = r.fired("straggler", st.rank), r.resolved("straggler", st.rank)
    out.append(
        f"- injected straggler rank {st.rank} (steps {st.from_step}-{(st.to_step or r.steps) - 1}): "
        f"{'fired' if f else 'NOT fired'}, {'resolved' if rs else 'NOT resolved'}"
    )
    first = [x for x in r.samples if x.t_s <= 60.0] or r.samples[:1]
    last = [x for x in r.samples if x.t_s >= end.t_s - 60.0]
    f_rss, l_rss = max(x.rss_mb for x in first), max(x.rss_mb for x in last)
    f_lag, l_lag = max(x.lag for x in first), max(x.lag for x in last)
    f_cpu = sum(x.cpu_pct for x in first) / len(first)
    l_cpu = sum(x.cpu_pct for x in last) / len(last)
    out.append(
        f"- last minute / first minute: RSS {l_rss:.0f}/{f_rss:.0f} MB = {l_rss / f_rss:.2f}x; "
        f"max lag {l_lag:,}/{f_lag:,} entries = {l_lag / max(f_lag, 1):.2f}x; "
        f"aggregator CPU {l_cpu:.0f}/{f_cpu:.0f}% of a core"
    )
    if r.final_line:
        out.append(f"- aggregator: {r.final_line.strip()}")
    return out


# ---- one job over several aggregators (argus aggregate --shard I/N, issue 16 item 0) -------------------


def _redis_cpu(client: Any) -> float:
    """CPU seconds the redis-server has used (it is single-threaded: one job's keys are one master's)."""
    c = client.info("cpu")
    return float(c["used_cpu_user"]) + float(c["used_cpu_sys"])


def _hwm_mb() -> float:
    """This process's peak RSS since its exec (ru_maxrss would include the parent's at the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def shard_child(url: str, job: str, shard: int, shards: int, idle_s: float) -> Dict[str, Any]:
    """One `--shard I/N` member (argus.aggregator.sharded.Member) until it had nothing to do for
    `idle_s` after having worked: its CPU by role, what it routed and judged, its peak RSS."""
    from argus import redisconf
    from argus.aggregator.sharded import Member
    from argus.gctune import tune_gc

    tune_gc()  # as `argus aggregate` does
    client = redisconf.parse(url).client(timeout_s=10)
    m = Member(client, shard, shards, jobs=[job], consumer=f"m{shard}", lease_s=5.0)
    last = time.monotonic()
    worked = False
    while True:
        if m.poll(idle_ms=20):
            last, worked = time.monotonic(), True
        elif time.monotonic() - last > (idle_s if worked else 120.0):
            break
    m.close()
    st = m.stats
    red = m.members[job].reducing if job in m.members else None
    return {
        "shard": shard,
        "routed": st.routed,
        "entries": st.entries,
        "reduced": st.reduced,
        "cpu_s": st.cpu_s,
        "cpu_route_s": st.cpu_route_s,
        "cpu_shard_s": st.cpu_shard_s,
        "cpu_reduce_s": st.cpu_reduce_s,
        "cpu_plan_s": st.cpu_plan_s,
        "short": red.reducer.stats.short if red else 0,
        "hwm_mb": _hwm_mb(),
    }


def _alert_set(client: Any, job: str) -> List[Tuple[str, Tuple[int, ...], str]]:
    from argus.aggregator.service import current

    return sorted((a.kind, tuple(a.ranks), a.state) for a in current(client, job))


def sharded_replay(url: str, n: int, steps: int, tp: int, shards: int) -> Dict[str, Any]:
    """The same replay (`n` ranks, `tp`, a 1.3x straggler from the middle step) judged by one
    aggregator, then by `shards` members, on an otherwise idle Redis: alerts, CPU, Redis CPU, RSS."""
    from argus import redisconf
    from argus.replay import publish_all

    client = redisconf.parse(url).client(timeout_s=30)
    one, split = f"eq-one-{n}-{tp}", f"eq-sh-{n}-{tp}-{shards}"
    for job in (one, split):  # generated twice rather than held: this process's RSS stays small
        items = synthetic_steps(job, n, steps, straggler=_straggler(n, steps), seed=2, tp=tp)
        publish_all(client, items, maxlen=n * steps + 1000)
    r0 = _redis_cpu(client)
    child = ["--child", url, one, str(n * steps), "one", "3", "nolease"]
    base = json.loads(_spawn(child).communicate()[0].splitlines()[-1])
    r1 = _redis_cpu(client)
    procs = [_spawn(["--shard-child", url, split, str(i), str(shards), "3"]) for i in range(shards)]
    members = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    r2 = _redis_cpu(client)
    a_one, a_split = _alert_set(client, one), _alert_set(client, split)
    filt = filter_cost(url, one, shards)  # the job's stream read whole again, as each member would
    client.delete(f"argus:{{{one}}}:steps", f"argus:{{{split}}}:steps")
    for i in range(shards):
        client.delete(f"argus:{{{split}}}:shard:{i}:steps")
    return {
        "ranks": n,
        "tp": tp,
        "entries": n * steps,
        "one": base,
        "members": members,
        "redis_one_s": r1 - r0,
        "redis_split_s": r2 - r1,
        "alerts_one": a_one,
        "alerts_split": a_split,
        "filter": filt,
    }


def filter_cost(url: str, job: str, shards: int) -> Dict[str, float]:
    """The alternative to routing: every aggregator reads the whole job stream (XREAD) and keeps the
    entries of its ranks (the rank peeked, as the router does). Per entry: this reader's CPU and
    Redis's CPU; each of the N aggregators would pay them for every entry of the job."""
    from argus import redisconf
    from argus.aggregator.sharded import peek_rank
    from argus.rediskeys import k_steps

    client = redisconf.parse(url).client(timeout_s=30)
    cursor, n, kept = "0", 0, 0
    r0, t0 = _redis_cpu(client), time.process_time()
    while True:
        got = client.xread({k_steps(job): cursor}, count=1024)
        if not got:
            break
        for eid, fields in got[0][1]:
            cursor = eid
            r = peek_rank(fields.get(b"d"))
            n += 1
            kept += int(r is not None and r % shards == 0)
    cpu, red = time.process_time() - t0, _redis_cpu(client) - r0
    return {"entries": n, "kept": kept, "us_client": 1e6 * cpu / max(n, 1), "us_redis": 1e6 * red / max(n, 1)}


def _lag(client: Any, key: str, group: str) -> Tuple[int, int]:
    """(lag, pending) of a consumer group on a stream (lag: entries not yet delivered)."""
    try:
        groups = client.xinfo_groups(key)
    except Exception:  # no stream yet
        return 0, 0
    for g in groups:
        name = g.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == group:
            lag = g.get("lag")
            if lag is None:
                lag = int(client.xinfo_stream(key).get("entries-added") or 0) - int(
                    g.get("entries-read") or 0
                )
            return int(lag), int(g.get("pending") or 0)
    return client.xlen(key), 0


@dataclass
class LiveRun:
    label: str
    procs: int
    cpu_pct: List[float] = field(default_factory=list)  # per process, over the run
    rss_mb: List[float] = field(default_factory=list)  # per process, peak
    judged: List[int] = field(default_factory=list)  # summaries each judged
    cpu_s: List[float] = field(default_factory=list)
    max_lag: int = 0  # summaries published and not yet delivered to whoever judges them
    max_pending: int = 0  # delivered, not yet acknowledged (entries: bundles, for members)
    named_s: Optional[float] = None  # straggler alert after its first slow step was published
    alerts: List[Tuple[str, Tuple[int, ...], str]] = field(default_factory=list)
    published: int = 0
    rate: float = 0.0
    drained_s: Optional[float] = None


def live_pipeline(url: str, ranks: int, duration_s: float, shards: int, label: str) -> LiveRun:
    """`argus aggregate` (shards 0: one plain aggregator; else `--shard I/N` members) as users run
    it, while this process publishes `ranks` summaries per second (one job step a second)."""
    import re

    from argus import redisconf
    from argus.aggregator.service import history
    from argus.rediskeys import k_reduce, k_shard_steps, k_steps
    from argus.replay import publish_all

    job = f"live-{shards}"
    client = redisconf.parse(url).client(timeout_s=30)
    base = [sys.executable, "-m", "argus", "aggregate", "--redis", url, "--job", job, "-q"]
    cmds = (
        [base]
        if shards == 0
        else [[*base, "--shard", f"{i}/{shards}", "--lease", "5"] for i in range(shards)]
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(REPO), env=env
        )
        for c in cmds
    ]
    time.sleep(2.0)
    steps = max(4, int(duration_s))
    st = Straggler(rank=ranks // 3, factor=FACTOR, from_step=int(steps * 0.4))
    run = LiveRun(label, len(procs))
    t_onset: Dict[str, float] = {}

    def paced() -> Any:
        for rs in synthetic_steps(
            job, ranks, steps, straggler=st, seed=7, step_ms=1000.0, start_ns=time.time_ns()
        ):
            if rs.step == st.from_step and rs.rank == 0:
                t_onset["t"] = time.time()
            yield rs

    done = threading.Event()
    res: Dict[str, Any] = {}
    client_pub = redisconf.parse(url).client(timeout_s=30)

    def publish() -> None:
        res["stats"] = publish_all(client_pub, paced(), rate=float(ranks), maxlen=ranks * steps + 1000)
        done.set()

    def backlog() -> Tuple[int, int]:
        if shards == 0:
            return _lag(client, k_steps(job), "argus-aggregate")
        lag, pend = _lag(client, k_steps(job), "argus-aggregate:route")
        for i in range(shards):  # bundles not yet read: count their summaries
            a, b = _lag(client, k_shard_steps(job, i), "argus-aggregate")
            if a:
                for _eid, f in client.xrevrange(k_shard_steps(job, i), count=a):
                    lag += len(msgpack.unpackb(f[b"b"]))
            pend += b
        return lag, pend

    import msgpack

    cpu0 = [_proc_cpu_s(p.pid) for p in procs]
    rss = [0.0] * len(procs)
    t0 = time.monotonic()
    threading.Thread(target=publish, daemon=True).start()
    while not done.wait(2.0):
        for i, p in enumerate(procs):
            rss[i] = max(rss[i], _proc_rss_mb(p.pid))
        lag, pend = backlog()
        run.max_lag, run.max_pending = max(run.max_lag, lag), max(run.max_pending, pend)
    t_end = time.monotonic()
    while time.monotonic() - t_end < 30:
        lag, _pend = backlog()
        if lag == 0:
            run.drained_s = time.monotonic() - t_end
            break
        time.sleep(0.2)
    time.sleep(3.0)  # the last steps judged and reduced
    wall = time.monotonic() - t0
    for i, p in enumerate(procs):
        rss[i] = max(rss[i], _proc_rss_mb(p.pid))
        cpu = _proc_cpu_s(p.pid) - cpu0[i]
        run.cpu_s.append(cpu)
        run.cpu_pct.append(100 * cpu / wall)
        p.send_signal(signal.SIGTERM)
    for p in procs:
        err = p.communicate(timeout=60)[1]
        last = next((x for x in reversed(err.splitlines()) if "summaries" in x), "")
        m = re.search(r"(\d+) judged", last) if shards else re.match(r"(\d+) summaries", last)
        run.judged.append(int(m.group(1)) if m else 0)
    run.rss_mb = rss
    run.published = res["stats"].entries
    run.rate = run.published / (t_end - t0)
    for eid, a in history(client, job):
        if a.state == "firing" and a.kind == "straggler" and st.rank in a.ranks and run.named_s is None:
            run.named_s = int(eid.decode().split("-")[0]) / 1000 - t_onset.get("t", 0.0)
    run.alerts = _alert_set(client, job)
    client.delete(k_steps(job), k_reduce(job), *[k_shard_steps(job, i) for i in range(max(shards, 1))])
    return run


def _each(xs: List[float], fmt: str = "{:,.0f}") -> str:
    return " / ".join(fmt.format(x) for x in xs)


def sharded_live_report(url: str, ranks: int, duration_s: float, shards: int) -> bool:
    print(
        f"\n## live: {ranks:,} ranks at 1 step/s for {duration_s:.0f} s, as users run it "
        f"(`argus aggregate`, then `--shard 0/1`, then {shards} x `--shard I/{shards}`)\n"
    )
    print(
        "| run | processes | summaries/s published | summaries judged (each) | CPU % of a core (each) | "
        "judged per CPU-s (each) | peak RSS MB (each) | max backlog, summaries (s of job time) | "
        "max pending entries | straggler named after s | alerts as the baseline's |"
    )
    print("|---|---:|---:|---|---|---|---|---:|---:|---:|---|")
    runs = []
    for k, label in (
        (0, "one aggregator (baseline)"),
        (1, "`--shard 0/1`"),
        (shards, f"`--shard I/{shards}`"),
    ):
        r = live_pipeline(url, ranks, duration_s, k, label)
        runs.append(r)
        same = "yes" if r.alerts == runs[0].alerts else "NO"
        named = f"{r.named_s:.1f}" if r.named_s is not None else "not named"
        print(
            f"| {r.label} | {r.procs} | {r.rate:,.0f} | {_each(r.judged)} | {_each(r.cpu_pct)} | "
            f"{_each([j / max(c, 1e-9) for j, c in zip(r.judged, r.cpu_s)])} | {_each(r.rss_mb)} | "
            f"{r.max_lag:,} ({r.max_lag / ranks:.2f} s) | {r.max_pending:,} | {named} | {same} |",
            flush=True,
        )
    base = runs[0]
    for r in runs[1:]:
        print(
            f"\n{r.label}: CPU in all {sum(r.cpu_s) / max(sum(base.cpu_s), 1e-9):.2f}x the baseline's; "
            f"busiest process {max(r.cpu_pct) / max(max(base.cpu_pct), 1e-9):.2f}x the baseline's"
        )
    return all(r.alerts == base.alerts for r in runs)


def sharded_report(
    url: str,
    ranks: int,
    steps: int,
    scale: List[int],
    scale_steps: int,
    shards: int,
    live_ranks: int,
    live_s: float,
) -> int:
    print("# one job over several aggregators (`argus aggregate --shard I/N`)\n")
    print(f"## a replay judged by one aggregator, then by {shards} members (routing, shards, reduce)\n")
    print(
        "| ranks x steps | layout | summaries judged: one / members | alerts one / members | same | "
        "CPU s one | CPU s members, each (route+shard+reduce+plan) | rank-steps per CPU-s: one | members | "
        "ratio | Redis CPU µs/summary: one | members | peak RSS MB: one | members |"
    )
    print("|---|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    ok = True
    runs = []
    plan = ([(ranks, steps, 1), (ranks, steps, 8)] if ranks else []) + [(n, scale_steps, 1) for n in scale]
    for n, k, tp in plan:
        r = sharded_replay(url, n, k, tp, shards)
        runs.append(r)
        same = r["alerts_one"] == r["alerts_split"]
        ok = ok and same
        e = r["entries"]
        one_rate, m_rate = e / r["one"]["cpu_s"], e / sum(m["cpu_s"] for m in r["members"])
        parts = " / ".join(
            f"{m['cpu_s']:.1f} ({m['cpu_route_s']:.1f}+{m['cpu_shard_s']:.1f}+{m['cpu_reduce_s']:.1f}"
            f"+{m['cpu_plan_s']:.1f})"
            for m in r["members"]
        )
        layout = "DP (its communicator cut)" if tp == 1 else "TP=8 x DP (TP whole, DP cut)"
        redis_one, redis_split = 1e6 * r["redis_one_s"] / e, 1e6 * r["redis_split_s"] / e
        ms = r["members"]
        print(
            f"| {n:,} x {k} | {layout} | {r['one']['entries']:,} / {_each([m['entries'] for m in ms])} | "
            f"{len(r['alerts_one'])} / {len(r['alerts_split'])} | "
            f"{'yes' if same else 'NO'} | {r['one']['cpu_s']:.1f} | {parts} | {one_rate:,.0f} | "
            f"{m_rate:,.0f} | {m_rate / one_rate:.2f} | {redis_one:.1f} | {redis_split:.1f} | "
            f"{r['one']['hwm_mb']:.0f} | {_each([m['hwm_mb'] for m in r['members']])} |",
            flush=True,
        )
        if not same:
            print(f"\nDIFFER: one {r['alerts_one'][:6]} / members {r['alerts_split'][:6]}\n")
    r = runs[-1]  # the largest data-parallel replay: shards of its size cost what they will
    e = r["entries"]
    ms = r["members"]
    route_us = 1e6 * sum(m["cpu_route_s"] for m in ms) / max(sum(m["routed"] for m in ms), 1)
    judge_us = 1e6 * sum(m["cpu_shard_s"] for m in ms) / max(sum(m["entries"] for m in ms), 1)
    reduce_us = 1e6 * sum(m["cpu_reduce_s"] for m in ms) / e
    member_us = route_us + judge_us + reduce_us
    f = r["filter"]
    print(
        f"\n## per summary ({r['ranks']:,} ranks, {r['ranks'] // shards:,} a shard), and instead of routing\n"
    )
    print("| path | client CPU µs/summary | Redis CPU µs/summary |")
    print("|---|---:|---:|")
    one_us, one_redis = 1e6 * r["one"]["cpu_s"] / e, 1e6 * r["redis_one_s"] / e
    print(f"| one aggregator (read, decode, judge) | {one_us:.0f} | {one_redis:.1f} |")
    print(f"| member, route: read through a group, peek the rank, append bundles, ack | {route_us:.1f} | |")
    print(f"| member, judge its shard: read, decode, judge, partials | {judge_us:.0f} | |")
    plan_s = sum(m["cpu_plan_s"] for m in ms)
    print(f"| member, reduce (per summary of the job) | {reduce_us:.1f} | |")
    print(f"| member, the plan, once per job ({r['ranks']:,} first summaries decoded) | {plan_s:.1f} s | |")
    print(f"| members in all (the plan apart) | {member_us:.0f} | {1e6 * r['redis_split_s'] / e:.1f} |")
    print(
        "| instead of routing, every member reads the whole stream (XREAD), keeps its ranks: per member | "
        f"{f['us_client']:.1f} | {f['us_redis']:.2f} |"
    )
    rate = 100_000
    need = -(-rate * member_us // 800_000)  # members at 80% of a core each
    filt = rate * (need * f["us_client"] + judge_us + reduce_us) / 1e6
    print(
        f"\n100,000 ranks at 1 step/s = 100,000 summaries/s: {rate * member_us / 1e6:.1f} cores of members "
        f"-> N = {need:.0f} at 80% of a core each (route {rate * route_us / 1e6:.1f}, judge "
        f"{rate * judge_us / 1e6:.1f}, reduce {rate * reduce_us / 1e6:.1f}); the aggregators' side of Redis "
        f"{rate * r['redis_split_s'] / e:.2f} s of CPU a second on the job's master, beside the agents' "
        f"XADDs. Each of the N members reading the whole stream instead: {filt:.1f} cores, "
        f"{need * rate * f['us_redis'] / 1e6:.2f} s/s of Redis for the reads alone."
    )
    if live_ranks:
        ok = sharded_live_report(url, live_ranks, live_s, shards) and ok
    return 0 if ok else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--shard-child":
        url, job, shard, shards, idle = sys.argv[2:7]
        print(json.dumps(shard_child(url, job, int(shard), int(shards), float(idle))))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, job, total, consumer, idle = sys.argv[2:7]
        lease = sys.argv[7:8] != ["nolease"]
        print(json.dumps(aggregate_child(url, job, int(total), consumer, float(idle), lease)))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        print(json.dumps(engine_only(int(sys.argv[2]), int(sys.argv[3]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1024,10000")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--live-steps", type=int, default=16)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--soak", type=float, metavar="SECONDS", help="Only the soak, for this long.")
    ap.add_argument("--soak-ranks", type=int, default=10_000)
    ap.add_argument("--step-s", type=float, default=2.0, help="Soak: one job step every this many seconds.")
    ap.add_argument("--sharded", action="store_true", help="Only one job over several aggregators (--shard).")
    ap.add_argument("--shards", type=int, default=2, help="With --sharded: members.")
    ap.add_argument(
        "--shard-ranks", type=int, default=1024, help="With --sharded: ranks of the replays (0: none)."
    )
    ap.add_argument("--shard-scale", default="16384", help="With --sharded: larger DP replays (ranks, ...).")
    ap.add_argument("--shard-scale-steps", type=int, default=8, help="With --sharded: their steps.")
    ap.add_argument(
        "--shard-live-ranks", type=int, default=2048, help="With --sharded: ranks live (0: none)."
    )
    ap.add_argument(
        "--shard-live-s", type=float, default=40.0, help="With --sharded: seconds of each live run."
    )
    args = ap.parse_args()
    if args.sharded:
        proc, url = start_redis()
        try:
            scale = [int(x) for x in args.shard_scale.split(",") if x.strip()]
            return sharded_report(
                url,
                args.shard_ranks,
                args.steps,
                scale,
                args.shard_scale_steps,
                args.shards,
                args.shard_live_ranks,
                args.shard_live_s,
            )
        finally:
            proc.terminate()
    if args.soak:
        proc, url = start_redis()
        try:
            soaked = soak(url, args.soak_ranks, args.soak, args.step_s, say=lambda x: print(x, flush=True))
        finally:
            proc.terminate()
        print("\n".join(soak_verdict(soaked)))
        return 0 if soaked.alive else 1
    sizes = [int(x) for x in args.ranks.split(",")]
    print("# aggregator scale (synthetic summaries, 24 all-reduces per rank-step)\n")
    print("## engine alone, one core\n")
    print("| ranks | rank-steps | CPU s | rank-steps/s | straggler named at step (onset) | peak RSS MB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        p = _spawn(["--engine", str(n), str(args.steps)])
        r = json.loads(p.communicate()[0].strip().splitlines()[-1])
        print(
            f"| {n} | {r['rank_steps']} | {r['cpu_s']:.2f} | {r['rate']:,.0f} | "
            f"{r['named_at']} ({r['onset']}) | {r['rss_mb']:.0f} |",
            flush=True,
        )
    if args.no_redis:
        return 0
    proc, url = start_redis()
    try:
        print("\n## through Redis: decode + every level, consumer group\n")
        print("| ranks | aggregators | entries taken (each) | CPU s (each) | rank-steps/s/core | RSS MB |")
        print("|---:|---:|---|---|---:|---:|")
        for n in sizes:
            for k in (1, 2):
                rs = through_redis(url, n, args.steps, k)
                taken = " / ".join(str(r["entries"]) for r in rs)
                cpu = " / ".join(f"{r['cpu_s']:.1f}" for r in rs)
                rate = sum(r["entries"] for r in rs) / max(sum(r["cpu_s"] for r in rs), 1e-9)
                rss = max(r["rss_mb"] for r in rs)
                print(f"| {n} | {k} | {taken} | {cpu} | {rate:,.0f} | {rss:.0f} |", flush=True)
        print("\n## live, 1 step/s: end-to-end detection latency\n")
        print("| ranks | summaries/s published | straggler named after (s from its first slow step) |")
        print("|---:|---:|---:|")
        for n in sizes:
            r = live(url, n, args.live_steps)
            lat = f"{r['latency_s']:.1f}" if r.get("latency_s") is not None else "not named"
            print(f"| {n} | {n} | {lat} |", flush=True)
    finally:
        proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
