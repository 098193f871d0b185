"""Bytes per rank per step that `argus probe --redis` stores in Redis, next to the raw event volume.

Run (root: it loads BPF): ``sudo .venv/bin/python -m benchmarks.summary_size``

For the simulated job at default rates (``--preset default --layout dp``) and at a heavy setting
(``--preset heavy --layout tp-dp``: >= 2,000 launches and >= 200 collectives per rank per step) it
runs 4 ranks under ``argus probe --json --redis --launch-steps all --launch-latency`` (the fullest
summary; a private redis-server on a free port) and reports:

* the stream entry payload (the ``d`` field) per rank per step: median and p99, and the Redis memory
  per entry (``MEMORY USAGE`` of the stream / entries); the one-time kernel-name table is separate;
* the raw event volume of the same steps: every launch, NCCL call, sync, timer read, event record,
  copy and allocation as one fixed-size ring-buffer record of the agent's own formats (header 32 B:
  launch 48 B, NCCL call 96 B, sync 64 B, timer 56 B, event record 48 B, copy/alloc 64 B, other calls
  and errors 32 B) — what shipping events instead of summaries would move — and the ``--json`` line;
* per field, KDE clusters vs a plain log2 histogram vs per-instance values for the collective host
  times (size and fidelity against the exact samples in the JSON), and KDE vs log2 for the launch
  latency (which BPF already keeps as a log2 histogram).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from argus import wire
from argus.probes.records import RecElapsed, RecEventRecord, RecHdr, RecNccl, RecSync
from argus.rediskeys import k_names, k_steps
from argus.sim.launcher import SimConfig, SimJob
from benchmarks.kde import (
    compress,
    empirical_quantile,
    hist_quantile,
    log2_hist,
    mixture_quantile,
    quantile_fn_w1,
    quantize,
    to_mixture,
)
from tests.redisproc import RedisProc

BUDGET = 2700
HDR = ctypes.sizeof(RecHdr)
RAW = {
    "launch": HDR + 16,
    "nccl": ctypes.sizeof(RecNccl),
    "sync": ctypes.sizeof(RecSync),
    "timer": ctypes.sizeof(RecElapsed),
    "event": ctypes.sizeof(RecEventRecord),
    "copy": ctypes.sizeof(RecSync),
    "call": HDR,
}


def pct(xs: Sequence[float], q: float) -> float:
    return empirical_quantile(list(xs), q)


def raw_bytes(d: dict) -> int:
    cuda, nccl = d["cuda"], d["nccl"]
    n = cuda["launches"]["total"] * RAW["launch"]
    n += len(nccl["arrivals"]) * RAW["nccl"]
    n += (nccl.get("groups", 0) + sum(nccl.get("calls", {}).values())) * RAW["call"]
    n += cuda["sync"]["count"] * RAW["sync"] + len(cuda["timers"]) * RAW["timer"]
    n += cuda.get("event_records", 0) * RAW["event"]
    n += sum(v["count"] for v in cuda["memcpy"].values()) * RAW["copy"]
    n += sum(v["count"] for v in cuda.get("memory", {}).values()) * RAW["copy"]
    n += sum(d.get("cudart", {}).get("calls", {}).values()) * RAW["call"]
    for sec in ("cuda", "cudart", "nccl"):
        n += sum(c for codes in d.get(sec, {}).get("errors", {}).values() for c in codes.values()) * HDR
    return n


def run_setting(url: str, preset: str, layout: str, ranks: int, steps: int, extra: List[str]) -> dict:
    import redis

    job = SimJob(SimConfig(ranks=ranks, steps=steps, preset=preset, layout=layout, gate=True)).start()
    try:
        job.wait_loaded()
        # the fullest summary: launch counts at every step and the launch-latency clusters (the
        # defaults send less: no clusters, and no kernel counts in 9 steps of 10)
        args = [sys.executable, "-m", "argus", "probe", "--json", "-i", "0.5s", "--redis", url]
        args += ["--launch-steps", "all", "--launch-latency", *extra]
        for pid in job.pids.values():
            args += ["-p", str(pid)]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
            deadline = time.monotonic() + 120
            while True:
                err.seek(0)
                text = err.read()
                if "Tracing" in text:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"argus probe did not start:\n{text}")
                time.sleep(0.1)
            job.release()
            out, _ = proc.communicate(timeout=600)
            err.seek(0)
            stderr = err.read()
        job.wait()
    finally:
        job.stop()
    printed = [json.loads(x) for x in out.splitlines() if x.strip()]
    steps_printed = [d for d in printed if d["step"] is not None]
    job_id = printed[0]["job"]
    r = redis.Redis.from_url(url)
    entries: List[Tuple[bytes, Dict[bytes, bytes]]] = r.xrange(k_steps(job_id))  # type: ignore[assignment]
    sizes = [len(f[b"d"]) for _, f in entries]
    mem = int(r.memory_usage(k_steps(job_id), samples=0) or 0)
    names = r.hgetall(k_names(job_id))
    r.close()
    by_key = {(d["rank"], d["step"]): d for d in steps_printed}
    summary = next(line for line in stderr.splitlines() if "published" in line)
    return {
        "printed": printed,
        "steps": steps_printed,
        "sizes": sizes,
        "mem_per_entry": mem / max(1, len(entries)),
        "names_bytes": sum(len(k) + len(v) for k, v in names.items()),
        "names": len(names),
        "raw": [raw_bytes(d) for d in by_key.values()],
        "json": [len(json.dumps(d, separators=(",", ":"))) for d in by_key.values()],
        "launches": statistics.median(d["cuda"]["launches"]["total"] for d in steps_printed),
        "colls": statistics.median(len(d["nccl"]["arrivals"]) for d in steps_printed),
        "summary": summary,
    }


# ---- field choice: KDE clusters vs log2 histogram vs per-instance values ------------------------------


def _errors(xs: List[float], q50: float, q99: float, qfn: object) -> Tuple[float, float, float]:
    e50, e99 = pct(xs, 0.5), pct(xs, 0.99)
    srt = sorted(xs)
    mean = statistics.fmean(xs)
    w1 = quantile_fn_w1(qfn, lambda q: srt[min(len(srt) - 1, int(q * len(srt)))], points=400)  # type: ignore[arg-type]
    return abs(q50 - e50) / e50, abs(q99 - e99) / e99, w1 / mean


def compare_host_times(steps: List[dict]) -> Dict[str, List[Tuple[int, float, float, float]]]:
    """Per (rank, step, comm, op) group of collective host times: (bytes, p50 err, p99 err, W1/mean)."""
    out: Dict[str, List[Tuple[int, float, float, float]]] = {"kde": [], "log2": [], "per-instance": []}
    for d in steps:
        groups: Dict[Tuple[str, str], List[float]] = {}
        for a in d["nccl"]["arrivals"]:
            groups.setdefault((a[0], a[2]), []).append(float(max(1, a[5])))
        for xs in groups.values():
            if len(xs) < 5:
                continue
            cl = compress(xs)
            mix = to_mixture(cl)
            out["kde"].append(
                (
                    len(msgpack.packb(quantize(cl))),
                    *_errors(
                        xs,
                        mixture_quantile(mix, 0.5),
                        mixture_quantile(mix, 0.99),
                        lambda q, m=mix: mixture_quantile(m, q),  # type: ignore[misc]
                    ),
                )
            )
            h = log2_hist(xs)
            out["log2"].append(
                (
                    len(msgpack.packb(h)),
                    *_errors(
                        xs, hist_quantile(h, 0.5), hist_quantile(h, 0.99), lambda q, h=h: hist_quantile(h, q)
                    ),
                )
            )
            qs = [wire.host_q(int(x)) for x in xs]
            back = sorted(float(wire.host_unq(q)) for q in qs)
            base = min(qs)
            out["per-instance"].append(
                (
                    len(msgpack.packb([q - base for q in qs])) + 2,
                    *_errors(
                        xs,
                        pct(back, 0.5),
                        pct(back, 0.99),
                        lambda q, b=back: b[min(len(b) - 1, int(q * len(b)))],  # type: ignore[misc]
                    ),
                )
            )
    return out


def compare_launch_latency(steps: List[dict]) -> Dict[str, List[int]]:
    out: Dict[str, List[int]] = {"kde": [], "log2": []}
    for d in steps:
        h = {int(k): int(v) for k, v in d["cuda"]["launches"]["api_ns_log2_hist"].items()}
        if not h:
            continue
        samples = [2.0**b * math.sqrt(2.0) for b, c in h.items() for _ in range(c)]
        out["kde"].append(len(msgpack.packb(quantize(compress(samples)))))
        out["log2"].append(len(msgpack.packb(h)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps-default", type=int, default=30)
    ap.add_argument("--steps-heavy", type=int, default=15)
    ap.add_argument("--probe-arg", action="append", default=[], help="extra argus probe argument")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("ERROR: this benchmark loads BPF: run it as root", file=sys.stderr)
        return 3
    with tempfile.TemporaryDirectory(prefix="argus-bench-redis-") as tmp:
        srv = RedisProc(Path(tmp)).start()
        try:
            runs = {
                "default (dp)": run_setting(srv.url, "default", "dp", a.ranks, a.steps_default, a.probe_arg),
                "heavy (tp-dp)": run_setting(srv.url, "heavy", "tp-dp", a.ranks, a.steps_heavy, a.probe_arg),
            }
        finally:
            srv.stop()
    print(f"# bytes per rank per step in Redis ({a.ranks} ranks, simulated job, budget {BUDGET} B)\n")
    print(
        "| setting | rank-steps | launches/step | NCCL calls/step | Redis entry median (B) | p99 (B) "
        "| max (B) | Redis memory/entry (B) | raw events median (B) | raw/entry | --json median (B) "
        "| json/entry |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name, r in runs.items():
        med, p99 = statistics.median(r["sizes"]), pct(r["sizes"], 0.99)
        raw, js = statistics.median(r["raw"]), statistics.median(r["json"])
        ok = ok and p99 <= BUDGET
        print(
            f"| {name} | {len(r['sizes'])} | {r['launches']:.0f} | {r['colls']:.0f} | {med:.0f} | {p99:.0f} "
            f"| {max(r['sizes'])} | {r['mem_per_entry']:.0f} | {raw:.0f} | {raw / med:.0f}× | {js:.0f} "
            f"| {js / med:.1f}× |"
        )
    for name, r in runs.items():
        names = f"{r['names']} names, {r['names_bytes']} B once per job"
        print(f"\n{name}: kernel-name table {names}; {r['summary']}")
    print("\n# collective host time per (rank, step, communicator, op): medians over groups\n")
    print("| setting | encoding | bytes | p50 rel. error | p99 rel. error | W1 / mean |")
    print("|---|---|---:|---:|---:|---:|")
    for name, r in runs.items():
        for enc, rows in compare_host_times(r["steps"]).items():
            cols = list(zip(*rows))
            b, e50, e99, w1 = (statistics.median(c) for c in cols)
            print(f"| {name} | {enc} | {b:.0f} | {e50:.2%} | {e99:.2%} | {w1:.2%} |")
    print("\n# launch-call latency (BPF keeps a log2 histogram): bytes per rank-step, median\n")
    for name, r in runs.items():
        c = compare_launch_latency(r["steps"])
        kde, hist = statistics.median(c["kde"]), statistics.median(c["log2"])
        print(f"- {name}: KDE clusters {kde:.0f} B, log2 histogram {hist:.0f} B")
    print(f"\nbudget {'met' if ok else 'MISSED'}: p99 <= {BUDGET} B in every setting")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
