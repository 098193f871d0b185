"""`argus top`: the cluster-wide live view of a job's ranks (reads Redis; needs no privileges)."""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from typing import Any, Optional

import click

from argus.errors import RedisUnavailable, UsageError
from argus.rediskeys import list_jobs
from argus.tui.draw import ViewOptions, render
from argus.tui.feed import Feed, detail

SORTS = ("late", "step", "rank")


def connect(url: str) -> Any:
    from argus import redisconf

    conf = redisconf.parse(url)
    client = conf.client()
    try:
        client.ping()
    except Exception as e:  # every connection failure means the same to the user
        raise RedisUnavailable(
            f"cannot reach Redis at {conf.display}: {e}",
            redisconf.connection_hint(
                e, conf.scheme, "start one (redis-server --port 6379 --save '' &) or pass --redis URL"
            ),
        ) from None
    return client


def pick_job(client: Any, job: Optional[str]) -> str:
    if job:
        return job
    known = list_jobs(client)
    if len(known) == 1:
        return known[0]
    if not known:
        raise UsageError(
            "no job has published to this Redis yet",
            "start `sudo argus probe --redis URL` on the training hosts, or give --job",
        )
    raise UsageError(f"several jobs in this Redis: {', '.join(known[:8])}", "choose one with --job")


@click.command("top")
@click.option(
    "--redis",
    "redis_url",
    default="redis://127.0.0.1:6379/0",
    show_default=True,
    metavar="URL",
    help="Where the agents publish (password from ARGUS_REDIS_PASSWORD[_FILE]).",
)
@click.option("--job", default=None, help="Job to show (default: the only one in Redis).")
@click.option("--once", is_flag=True, help="Print one frame and exit (also when stdout is not a terminal).")
@click.option("--ranks", "expected", type=int, default=None, help="Ranks expected (default: those seen).")
@click.option(
    "--sort",
    type=click.Choice(SORTS),
    default="late",
    show_default=True,
    help="Row order: lateness (flagged ranks first), step time, or rank.",
)
@click.option("--host", "host_filter", default=None, help="Only ranks on this host.")
@click.option(
    "--max-rows", type=int, default=30, show_default=True, help="Rank rows before grouping by host."
)
@click.option("-i", "--interval", type=float, default=1.0, show_default=True, help="Refresh every N seconds.")
@click.option(
    "--svg",
    "svg_path",
    default=None,
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="With --once: also save the frame as an SVG picture (for a ticket or a page).",
)
def top_cmd(
    redis_url: str,
    job: Optional[str],
    once: bool,
    expected: Optional[int],
    sort: str,
    host_filter: Optional[str],
    max_rows: int,
    interval: float,
    svg_path: Optional[str],
) -> int:
    """Live view of every rank of a job: who is late, how long steps take, what is firing.

    Rows are sorted by what matters: ranks named by an alert first, then arrival lateness at
    collectives (the rank everyone waits for), then step time. Keys: s sort, h cycle host filter,
    p pause, d drill into the top rank, q quit. Large jobs show the worst ranks and a host table.

    \b
    Examples:
      argus top --redis redis://127.0.0.1:6379/0
      argus top --job sim-1a2b3c4d --once          # one frame, for scripts and tickets
      argus top --sort step --host node-3
      argus top --once --svg top.svg               # the frame as a picture
    """
    client = connect(redis_url)
    job = pick_job(client, job)
    feed = Feed(client, job, expected)
    opts = ViewOptions(sort=sort, host=host_filter, max_rows=max_rows)
    if once or svg_path or not sys.stdout.isatty():
        feed.poll(block_ms=int(interval * 1000))
        from rich.console import Console

        width = max(120, os.get_terminal_size(0).columns if sys.stdin.isatty() else 200)
        console = Console(width=width, record=bool(svg_path))
        console.print(render(feed.snapshot(), opts))
        if svg_path:
            console.save_svg(svg_path, title=f"argus top - {job}")
            click.echo(f"wrote {svg_path}", err=True)
        for line in feed.notices():
            click.echo(line, err=True)
        return 0
    return _interactive(feed, opts, interval)


def _interactive(feed: Feed, opts: ViewOptions, interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    feed.poll(block_ms=100)
    feed.run(interval)
    console = Console()
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd) if sys.stdin.isatty() else None
    hosts: list = []
    try:
        if saved is not None:
            tty.setcbreak(fd)
        with Live(render(feed.snapshot(), opts), console=console, screen=True, auto_refresh=False) as live:
            frozen = None
            while True:
                if saved is not None:
                    key = _key(fd, interval)
                else:
                    time.sleep(interval)
                    key = ""
                if key == "q":
                    return 0
                if key == "s":
                    opts = _replace(opts, sort=SORTS[(SORTS.index(opts.sort) + 1) % len(SORTS)])
                elif key == "p":
                    opts = _replace(opts, paused=not opts.paused)
                    frozen = feed.snapshot() if opts.paused else None
                elif key == "h":
                    hosts = sorted({r.host for r in feed.snapshot().rows})
                    cycle = [None, *hosts]
                    opts = _replace(
                        opts,
                        host=cycle[(cycle.index(opts.host) + 1) % len(cycle)] if opts.host in cycle else None,
                    )
                elif key == "d":
                    if opts.detail is None:
                        snap = frozen or feed.snapshot()
                        from argus.tui.snapshot import sort_rows

                        rows = sort_rows(snap.rows, opts.sort)
                        rs = feed.last(rows[0].rank) if rows else None
                        opts = _replace(opts, detail=detail(rs) if rs else None)
                    else:
                        opts = _replace(opts, detail=None)
                snap = frozen or feed.snapshot()
                frame = render(snap, opts)
                notes = feed.notices()
                if feed.error or notes:
                    from rich.console import Group
                    from rich.text import Text

                    below = [Text(line, style="yellow") for line in notes]
                    if feed.error:
                        below.append(Text(f"Redis: {feed.error} (retrying)", style="bold red"))
                    frame = Group(frame, *below)
                live.update(frame, refresh=True)
    finally:
        feed.stop()
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _key(fd: int, timeout: float) -> str:
    r, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 1).decode(errors="ignore").lower() if r else ""


def _replace(o: ViewOptions, **kw: Any) -> ViewOptions:
    from dataclasses import replace

    return replace(o, **kw)
