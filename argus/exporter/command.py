"""`argus export-prometheus`: per-job and per-rank metrics from what is in Redis, for Prometheus
(the exposition itself, pure, is argus/exporter/prom.py)."""

from __future__ import annotations

import signal
import threading
from typing import Dict, Tuple

import click

from argus.rediskeys import list_jobs
from argus.tui.feed import Feed
from argus.tui.top import connect


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
    from argus.exporter.prom import render_metrics, serve

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
