"""`argus report`: a picture of a job from what is in Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import click

from argus.aggregator.commands import parse_steps
from argus.errors import UsageError
from argus.rediskeys import k_alerts
from argus.tui.feed import decode_alert
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
