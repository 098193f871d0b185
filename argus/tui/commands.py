"""`argus report` and `argus export-prometheus`: pictures and metrics from what is in Redis."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import click

from argus.aggregator.cli import parse_steps
from argus.errors import UsageError
from argus.rediskeys import k_alerts, list_jobs
from argus.tui.feed import Feed, decode_alert
from argus.tui.top import connect, pick_job


@click.command("report")
@click.option("--redis", "redis_url", default="redis://127.0.0.1:6379/0", show_default=True, metavar="URL")
@click.option("--job", default=None, help="Job (default: the only one in Redis).")
@click.option("--steps", "steps_text", default=None, metavar="A:B", help="Only these steps.")
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="report.png (a picture) or report.html (self-contained page).",
)
def report_cmd(redis_url: str, job: Optional[str], steps_text: Optional[str], output: str) -> int:
    """Draw a job: rank × step heatmaps of arrival lateness and step time, phases per rank, alerts.

    The straggler is the red row of the lateness heatmap; a slow link or a regression shows as a
    band across all rows of the step-time heatmap.

    \b
    Examples:
      argus report --job sim-1a2b3c4d -o report.png
      argus report --job train-42 --steps 400:600 -o window.html
    """
    from argus.reader import ReaderStats, iter_steps, say_skipped
    from argus.tui import report

    steps = parse_steps(steps_text)
    suffix = Path(output).suffix.lower()
    if suffix not in (".png", ".html", ".htm"):
        raise UsageError(f"cannot write '{output}': the report is .png or .html", "e.g. -o report.png")
    client = connect(redis_url)
    job = pick_job(client, job)
    stats = ReaderStats()
    summaries = [rs for _, rs in iter_steps(client, job, stats)]
    say_skipped(stats, job, len(summaries), lambda line: click.echo(line, err=True))
    if not summaries:
        raise UsageError(f"no summaries for job {job} in Redis", "is `argus probe --redis` running for it?")
    alerts: Dict[str, dict] = {}
    for _, fields in client.xrange(k_alerts(job), count=100_000):
        a = decode_alert(fields or {})
        if a is not None:
            alerts[a["id"]] = a  # the last transition of each alert
    data = report.build(job, summaries, list(alerts.values()), steps)
    if suffix == ".png":
        report.png(data, output)
    else:
        Path(output).write_text(report.html_page(data))
    click.echo(f"wrote {output}: {len(data.ranks)} ranks × {len(data.steps)} steps, {len(alerts)} alert(s)")
    return 0


@click.command("export-prometheus")
@click.option("--redis", "redis_url", default="redis://127.0.0.1:6379/0", show_default=True, metavar="URL")
@click.option("--job", "job_names", multiple=True, help="Jobs to export (default: every job in Redis).")
@click.option("--port", default=9464, show_default=True, help="Serve /metrics on this port.")
@click.option("--bind", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--max-ranks",
    default=1024,
    show_default=True,
    help="Per-rank series for at most this many ranks per job (the worst first).",
)
def export_prometheus_cmd(
    redis_url: str, job_names: Tuple[str, ...], port: int, bind: str, max_ranks: int
) -> int:
    """Serve per-job and per-rank metrics (step time, phases, lateness, alerts) for Prometheus.

    Cardinality is bounded: ~10 series per rank for at most --max-ranks ranks per job.

    \b
    Examples:
      argus export-prometheus --port 9464
      curl -s localhost:9464/metrics | grep argus_rank_arrival_lateness_seconds
    """
    from argus.tui.prom import render_metrics, serve

    client = connect(redis_url)
    feeds: Dict[str, Feed] = {}
    lock = threading.Lock()

    def refresh() -> None:
        names = list(job_names) or list_jobs(client)
        for j in names:
            if j not in feeds:
                feeds[j] = Feed(client, j)
                feeds[j].run(1.0)

    def source() -> str:
        with lock:
            refresh()
            return render_metrics([f.snapshot() for f in feeds.values()], max_ranks)

    refresh()
    srv = serve(port, source, bind)
    click.echo(
        f"serving http://{bind}:{port}/metrics for {', '.join(feeds) or 'jobs as they appear'} "
        f"(Ctrl-C to end)",
        err=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        srv.shutdown()
        for f in feeds.values():
            f.stop()
    return 0


def wait_for(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


__all__: List[str] = ["export_prometheus_cmd", "report_cmd"]
