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
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from argus.aggregator.engine import Engine  # noqa: E402
from argus.replay import Straggler, synthetic_steps  # noqa: E402

FACTOR = 1.3


def _straggler(n: int, steps: int) -> Straggler:
    return Straggler(rank=n // 3, factor=FACTOR, from_step=steps // 2)


def engine_only(n: int, steps: int) -> Dict[str, Any]:
    from argus.aggregator.service import tune_gc

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
    from argus.aggregator.service import Aggregator, tune_gc

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
    args = ap.parse_args()
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
