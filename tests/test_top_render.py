"""`argus top` rendering on fixed snapshots (8 and 10,000 ranks), into a string console."""

from __future__ import annotations

import time
from typing import List

from rich.console import Console

from argus.schema import CommStep, RankStep
from argus.tui.draw import ViewOptions, render, sparkline
from argus.tui.snapshot import JobView

T0 = 1_764_000_000 * 10**9


def steps(ranks: int, nsteps: int, late_rank: int, late_ns: int, hosts_of: int = 8) -> List[RankStep]:
    out = []
    for s in range(nsteps):
        base = T0 + s * 200_000_000
        for r in range(ranks):
            arrive = [
                base + 50_000_000 + i * 2_000_000 + (late_ns if r == late_rank else (r % 7) * 1000)
                for i in range(4)
            ]
            comm = CommStep(
                "d" * 16,
                ranks,
                r,
                "init",
                seqs=[1 + s * 4 + i for i in range(4)],
                ops=["AllReduce"] * 4,
                nbytes=[25 << 20] * 4,
                arrive_ns=arrive,
                host_ns=[9000] * 4,
            )
            out.append(
                RankStep(
                    job="j",
                    rank=r,
                    host=f"node-{r // hosts_of}",
                    pid=1000 + r,
                    step=s,
                    start_ns=base,
                    duration_ns=200_000_000,
                    phases={"timer0": 55_000_000, "host_wait": 160_000_000, "host_other": 40_000_000},
                    launches=600,
                    comms={"d" * 16: comm},
                )
            )
    return out


def view(ranks: int, late_rank: int) -> JobView:
    v = JobView("j", expected=ranks)
    for rs in steps(ranks, 6, late_rank, 40_000_000):
        v.ingest(rs)
    v.ingest_alert(
        {
            "id": "a1",
            "kind": "straggler",
            "severity": "warning",
            "job": "j",
            "ranks": [late_rank],
            "steps": [2, 5],
            "state": "firing",
            "summary": f"rank {late_rank} arrives last",
            "first_seen": T0,
            "last_seen": T0,
        }
    )
    return v


def text(renderable: object, styles: bool = False, width: int = 220) -> str:
    c = Console(record=True, width=width, force_terminal=True, color_system="truecolor")
    c.print(renderable)
    return c.export_text(styles=styles)


def test_eight_ranks_straggler_first_and_highlighted() -> None:
    snap = view(8, late_rank=3).snapshot()
    out = text(render(snap))
    rows = [ln for ln in out.splitlines() if ln.strip()[:1].isdigit() or ln.startswith(("│", "┃"))]
    table_rows = [ln.strip("│ ").split("│")[0].strip() for ln in out.splitlines() if ln.startswith("│")]
    assert table_rows[0] == "3", out  # rank is the first column, and the straggler sorts to the top
    assert len([r for r in table_rows[:8] if r.isdigit()]) == 8
    assert "ranks 8/8" in out and "+40.0" in out and "rank 3 arrives last" in out
    styled = text(render(snap), styles=True)
    first = next(ln for ln in styled.splitlines() if "node-0" in ln)
    assert "\x1b[1;31m" in first or "\x1b[1m\x1b[31m" in first  # bold red
    assert rows


def test_ten_thousand_ranks_group_and_stay_fast() -> None:
    v = view(10_000, late_rank=4242)
    t0 = time.perf_counter()
    snap = v.snapshot()
    out = text(render(snap, ViewOptions(max_rows=30)))
    elapsed = time.perf_counter() - t0
    assert "worst 16 of 10000 ranks" in out and "hosts (worst first)" in out
    first = next(ln for ln in out.splitlines() if ln.startswith("│"))
    assert first.strip("│ ").split("│")[0].strip() == "4242"
    assert "node-530" in out  # the straggler's host leads the host table
    assert elapsed < 2.0, elapsed


def test_host_filter_sort_and_sparkline() -> None:
    snap = view(16, late_rank=9).snapshot()
    out = text(render(snap, ViewOptions(host="node-0", sort="rank")))
    ranks = [ln.strip("│ ").split("│")[0].strip() for ln in out.splitlines() if ln.startswith("│")]
    assert ranks[:8] == [str(r) for r in range(8)] and "9" not in ranks[:8]
    assert sparkline([1, 2, 3, 4]) == "▁▃▆█" and sparkline([]) == ""


def test_prometheus_text_parses_with_histogram_and_bounded_ranks() -> None:
    """The exporter's text parses as Prometheus exposition; the step-time histogram counts every
    closed step; the late rank has the highest lateness; --max-ranks bounds per-rank series."""
    from prometheus_client.parser import text_string_to_metric_families

    from argus.exporter.prom import render_metrics

    snap = view(8, 3).snapshot()
    fams = {f.name: f for f in text_string_to_metric_families(render_metrics([snap]))}
    hist = fams["argus_job_step_time_seconds"]
    assert hist.type == "histogram"
    count = [s.value for s in hist.samples if s.name.endswith("_count")]
    inf = [s.value for s in hist.samples if s.labels.get("le") == "+Inf"]
    le_02 = [s.value for s in hist.samples if s.labels.get("le") == "0.1"]
    assert count == inf and count[0] >= 4, hist.samples  # 6 steps, the last `lag` may be open
    assert le_02 == [0.0]  # every step took 0.2 s
    late = {int(s.labels["rank"]): s.value for s in fams["argus_rank_arrival_lateness_seconds"].samples}
    assert max(late, key=lambda r: late[r]) == 3 and late[3] > 0.03
    coll = fams["argus_rank_collective_seconds"].samples
    assert len(coll) == 8 and all(abs(s.value - 36e-6) < 1e-9 for s in coll)
    few = {f.name: f for f in text_string_to_metric_families(render_metrics([snap], max_ranks=2))}
    kept = [int(s.labels["rank"]) for s in few["argus_rank_step_seconds"].samples]
    assert len(kept) == 2 and 3 in kept, kept  # the worst ranks are the ones kept


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    """deploy/grafana's dashboard is valid JSON and every metric its queries name is one the
    exporter serves (a renamed metric would silently blank a panel)."""
    import json
    import re
    from pathlib import Path

    from argus.exporter.prom import METRICS

    dash = json.loads(
        (Path(__file__).resolve().parents[1] / "deploy/grafana/argus-dashboard.json").read_text()
    )
    served = {name for name, _, _ in METRICS}
    served |= {
        f"{n}{suffix}" for n, t, _ in METRICS if t == "histogram" for suffix in ("_bucket", "_sum", "_count")
    }
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    named = {m for e in exprs for m in re.findall(r"\b(argus_[a-z_]+)", e)}
    assert named and named <= served, named - served
    assert all("$job" in e for e in exprs)  # every panel follows the job selector
