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


def aggregate_child(url: str, job: str, total: int, consumer: str, idle_s: float) -> Dict[str, Any]:
    """One aggregator process: consume until `total` entries were taken by the group (or idle)."""
    from argus import redisconf
    from argus.aggregator.service import Aggregator
    from argus.gctune import tune_gc

    tune_gc()  # as `argus aggregate` does
    client = redisconf.parse(url).client(timeout_s=10)
    agg = Aggregator(client, Engine(), [job], consumer=consumer, count=1024)
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


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, job, total, consumer, idle = sys.argv[2:7]
        print(json.dumps(aggregate_child(url, job, int(total), consumer, float(idle))))
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
    args = ap.parse_args()
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
