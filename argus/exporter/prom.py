"""Prometheus text exposition of job snapshots (pure), and a tiny HTTP server for it.

Label cardinality is bounded: per job 20 series (16 of them the step-time histogram); per rank
seven series (step time, host wait, lateness, last-arrival share, collective time, launch rate,
drops) plus one per display phase (at most six), for at most `max_ranks` ranks — the worst by
lateness when a job has more (default 1,024: a 10,000-rank job exports ~13k series, not ~130k);
alerts as one series per (kind, severity) plus one info series per
firing alert (there are few).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Iterable, List, Mapping, Tuple

from argus.gpu import BENIGN_REASONS
from argus.tui.snapshot import STEP_BUCKETS, JobSnapshot, sort_rows

# (RankStep.gpu key, metric, scale)
GPU_SERIES = (
    ("sm_mhz", "argus_rank_gpu_sm_clock_mhz", 1.0),
    ("power_w", "argus_rank_gpu_power_watts", 1.0),
    ("temp_c", "argus_rank_gpu_temperature_celsius", 1.0),
    ("util_pct", "argus_rank_gpu_utilization_ratio", 0.01),
)
METRICS: List[Tuple[str, str, str]] = [
    ("argus_job_step_seconds", "gauge", "Latest job step time (max over ranks)."),
    ("argus_job_ranks", "gauge", "Ranks reporting."),
    ("argus_job_step", "gauge", "Latest step number seen."),
    ("argus_job_step_time_seconds", "histogram", "Job step times (slowest rank) since the exporter started."),
    ("argus_rank_step_seconds", "gauge", "Latest step time of the rank."),
    ("argus_rank_host_wait_seconds", "gauge", "Time the rank's host blocked on the GPU in its latest step."),
    (
        "argus_rank_arrival_lateness_seconds",
        "gauge",
        "Rolling median of how late the rank arrives at collectives vs its group's median.",
    ),
    (
        "argus_rank_last_arrival_ratio",
        "gauge",
        "Fraction of recent collectives at which the rank arrived last.",
    ),
    ("argus_rank_collective_seconds", "gauge", "Host time inside NCCL calls in the rank's latest step."),
    ("argus_rank_launches_per_second", "gauge", "Kernel launches per second of step time."),
    ("argus_rank_drops", "gauge", "Records of the rank its agent lost, over every summary read."),
    ("argus_rank_gpu_sm_clock_mhz", "gauge", "SM clock of the rank's GPU (NVML, latest sample)."),
    ("argus_rank_gpu_power_watts", "gauge", "Power draw of the rank's GPU (NVML)."),
    ("argus_rank_gpu_temperature_celsius", "gauge", "Temperature of the rank's GPU (NVML)."),
    ("argus_rank_gpu_utilization_ratio", "gauge", "Utilisation of the rank's GPU, 0-1 (NVML)."),
    (
        "argus_rank_gpu_throttled",
        "gauge",
        "1 when the rank's GPU holds its clocks down for a reason other than idle, application clocks "
        "or a display (NVML clocks-event reasons), else 0.",
    ),
    ("argus_rank_phase_seconds", "gauge", "Time per display phase in the rank's latest step."),
    ("argus_alerts_firing", "gauge", "Firing alerts by kind and severity."),
    ("argus_alert_info", "gauge", "One series per firing alert (value 1)."),
]


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(d: Mapping[str, object]) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}"


def render_metrics(snaps: Iterable[JobSnapshot], max_ranks: int = 1024) -> str:
    series: Dict[str, List[str]] = {name: [] for name, _, _ in METRICS}

    def add(name: str, labels: Mapping[str, object], value: float) -> None:
        series[name].append(f"{name}{_labels(labels)} {value:.9g}")

    for s in snaps:
        job = {"job": s.job}
        if s.step_times:
            add("argus_job_step_seconds", job, s.step_times[-1])
        add("argus_job_ranks", job, s.ranks_seen)
        add("argus_job_step", job, s.step)
        if s.step_hist:
            hist = "argus_job_step_time_seconds"
            cum = 0
            for bound, n in zip([*STEP_BUCKETS, float("inf")], s.step_hist):
                cum += n
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                series[hist].append(f"{hist}_bucket{_labels({**job, 'le': le})} {cum}")
            series[hist].append(f"{hist}_sum{_labels(job)} {s.step_sum:.9g}")
            series[hist].append(f"{hist}_count{_labels(job)} {cum}")
        for r in sort_rows(s.rows)[:max_ranks]:
            lab = {"job": s.job, "rank": r.rank, "host": r.host}
            add("argus_rank_step_seconds", lab, r.step_ns / 1e9)
            add("argus_rank_host_wait_seconds", lab, dict(r.buckets).get("host_wait", 0) / 1e9)
            add("argus_rank_arrival_lateness_seconds", lab, r.late_ns / 1e9)
            add("argus_rank_last_arrival_ratio", lab, r.last_share)
            add("argus_rank_collective_seconds", lab, r.coll_ns / 1e9)
            add("argus_rank_launches_per_second", lab, r.launches_per_s)
            add("argus_rank_drops", lab, r.drops)
            g = dict(r.gpu_values)
            for gkey, metric, scale in GPU_SERIES:
                if gkey in g:
                    add(metric, lab, g[gkey] * scale)
            if "throttle" in g:
                add("argus_rank_gpu_throttled", lab, 1 if int(g["throttle"]) & ~BENIGN_REASONS else 0)
            for phase, ns in r.buckets:
                add("argus_rank_phase_seconds", {**lab, "phase": phase}, ns / 1e9)
        counts: Dict[Tuple[str, str], int] = {}
        for a in s.alerts:
            key = (a.get("kind", ""), a.get("severity", ""))
            counts[key] = counts.get(key, 0) + 1
            ranks = ",".join(str(x) for x in a.get("ranks", [])[:16])
            add(
                "argus_alert_info",
                {"job": s.job, "id": a.get("id", ""), "kind": key[0], "severity": key[1], "ranks": ranks},
                1,
            )
        for (kind, sev), n in sorted(counts.items()):
            add("argus_alerts_firing", {"job": s.job, "kind": kind, "severity": sev}, n)
    out = []
    for name, typ, help_ in METRICS:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {typ}")
        out.extend(series[name])
    return "\n".join(out) + "\n"


def serve(port: int, source: Callable[[], str], host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve `source()` at /metrics in a background thread; returns the server (call shutdown())."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = source().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # quiet
            pass

    srv = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv
