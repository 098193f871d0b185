"""`argus diagnose`: run every diagnosis level over recorded summaries and print what they found."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, List, Optional, Tuple

import click

from argus.aggregator.config import PhaseInfo, Thresholds
from argus.aggregator.diagnose import report_data, report_text
from argus.aggregator.engine import Engine, Item, JsonlSource
from argus.errors import UsageError
from argus.schema import Heartbeat


def parse_steps(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """'A:B' (inclusive), 'A:' or ':B'."""
    if not text:
        return None
    a, sep, b = text.partition(":")
    try:
        lo = int(a) if a.strip() else 0
        hi = int(b) if b.strip() else 2**62
    except ValueError:
        raise UsageError(
            f"--steps '{text}' is not A:B", "e.g. --steps 40:90, --steps 100: or --steps :50"
        ) from None
    if not sep or lo > hi:
        raise UsageError(f"--steps '{text}' is not A:B with A <= B", "e.g. --steps 40:90")
    return lo, hi


def by_time(items: Iterable[Item]) -> List[Item]:
    """Summaries and heartbeats in the order they happened (a summary when its step ended)."""
    return sorted(items, key=lambda x: x.ts_ns if isinstance(x, Heartbeat) else x.end_ns)


def redis_items(url: str, job: str) -> List[Item]:
    """Every summary and heartbeat the job's streams still hold (reads only; acknowledges nothing)."""
    from argus import reader, redisconf
    from argus.errors import RedisUnavailable

    conf = redisconf.parse(url)
    client = conf.client()
    stats = reader.ReaderStats()
    try:
        items: List[Item] = [rs for _id, rs in reader.iter_steps(client, job, stats)]
        items += [hb for _id, hb in reader.heartbeats(client, job, count=100_000, stats=stats)]
    except Exception as e:  # redis.ConnectionError and friends, without importing redis at module load
        if type(e).__module__.startswith("redis"):
            raise RedisUnavailable(
                f"cannot read job {job} from {conf.display}: {e}", redisconf.connection_hint(e, conf.scheme)
            ) from None
        raise
    reader.say_skipped(stats, job, len(items), lambda line: click.echo(line, err=True))
    return items


@click.command("diagnose")
@click.option("--from-jsonl", "jsonl", metavar="FILE", help="Summaries recorded with `argus probe --json`.")
@click.option(
    "--redis", "redis_url", metavar="URL", help="Read the job's summaries and heartbeats from Redis."
)
@click.option(
    "--job",
    default=None,
    help="The job (with --redis: default the only one there; with a file: only this job).",
)
@click.option("--steps", "steps", metavar="A:B", help="Report findings in these steps (inclusive).")
@click.option(
    "--phases",
    metavar="NAMES",
    help="Names of timer0, timer1, ... in order, for the report (e.g. forward,backward,optimizer,grad_sync).",
)
@click.option(
    "--comm-phases",
    metavar="LIST",
    help="Phases that time communication (default: timers that end on another stream than most timers).",
)
@click.option(
    "--set", "sets", multiple=True, metavar="NAME=VALUE", help="Override a threshold (docs/diagnosis.md)."
)
@click.option("-j", "--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def diagnose_cmd(
    jsonl: Optional[str],
    redis_url: Optional[str],
    job: Optional[str],
    steps: Optional[str],
    phases: Optional[str],
    comm_phases: Optional[str],
    sets: Tuple[str, ...],
    as_json: bool,
) -> int:
    """One-shot diagnosis of a job: stragglers, slow links, host stalls, hangs, step-time anomalies.

    Runs the aggregator's levels (L1 iteration time, L2 ranks and phases, L3 distributions, host
    stalls, hangs) over recorded per-rank step summaries, and says which rank, phase, link or host
    slowed the job, in which steps, with the numbers behind it.

    \b
    Examples:
      argus diagnose --from-jsonl steps.jsonl
      argus diagnose --from-jsonl steps.jsonl --steps 40:90 --phases forward,backward,optimizer,grad_sync
      argus diagnose --redis redis://127.0.0.1:6379/0 --job run-42 --json
    """
    if bool(jsonl) == bool(redis_url):
        raise UsageError(
            "give exactly one input: --from-jsonl FILE or --redis URL", "e.g. --from-jsonl steps.jsonl"
        )
    if redis_url and not job:
        from argus.tui.top import connect, pick_job

        job = pick_job(connect(redis_url), None)  # the only job there, or an error listing them
        click.echo(f"job {job} (the only one in this Redis)", err=True)
    rng = parse_steps(steps)
    try:
        th = Thresholds.from_pairs(list(sets))
    except ValueError as e:
        raise UsageError(str(e), "see docs/diagnosis.md for the thresholds") from None
    engine = Engine(th, PhaseInfo.parse(phases, comm_phases))
    if jsonl:
        try:
            items: List[Item] = list(JsonlSource(jsonl))
        except FileNotFoundError:
            raise UsageError(
                f"no such file: {jsonl}", "record one with: sudo argus probe --all --json > steps.jsonl"
            ) from None
    else:
        assert redis_url is not None and job is not None
        items = redis_items(redis_url, job)
    hi = rng[1] if rng else None
    for it in by_time(items):
        if job and it.job != job:
            continue
        if hi is not None and not isinstance(it, Heartbeat) and it.step is not None and it.step > hi:
            continue
        engine.add(it)
    engine.flush()
    data = report_data(engine, job, rng)
    if as_json:
        click.echo(json.dumps(data, indent=1))
    else:
        click.echo(report_text(data, rng))
    return 0


# ---- the service and its alerts (Redis) --------------------------------------------------------------


@contextmanager
def _redis_errors(url: str) -> Iterator[None]:
    """redis-py's connection errors become RedisUnavailable (ERROR/HINT, exit 8), not tracebacks."""
    from urllib.parse import urlsplit

    from argus.errors import RedisUnavailable
    from argus.redisconf import connection_hint

    try:
        yield
    except Exception as e:
        if type(e).__module__.startswith("redis"):
            hint = connection_hint(e, urlsplit(url).scheme.lower())
            raise RedisUnavailable(f"Redis at {url}: {e}", hint) from None
        raise


def _client(url: str) -> object:
    from argus import redisconf

    conf = redisconf.parse(url)
    for w in conf.warnings:
        click.echo(f"warning: {w}", err=True)
    return conf.client()


@click.command("aggregate")
@click.option(
    "--redis", "redis_url", required=True, metavar="URL", help="Where the agents publish summaries."
)
@click.option("--job", "jobs", multiple=True, help="Serve only this job (repeatable; default: every job).")
@click.option(
    "--group", default="argus-aggregate", show_default=True, help="Consumer group (shared by aggregators)."
)
@click.option("--consumer", default=None, help="This aggregator's consumer name (default: host:pid).")
@click.option(
    "--lease",
    type=float,
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="One aggregator leads each job; others stand by and take over (with its pending summaries) "
    "this long after the leader stops renewing. 0: no leader, aggregators split each job's summaries.",
)
@click.option(
    "--shard",
    metavar="I/N",
    default=None,
    help="Split each job over N aggregators started alike with I = 0 .. N-1 (one job too large for "
    "one): they route its summaries by rank, each judges one shard, one of them the whole job's step "
    "time; a member that dies is taken over after --lease.",
)
@click.option("-d", "--duration", type=float, default=None, metavar="SECONDS", help="Stop after this long.")
@click.option("--phases", metavar="NAMES", help="Names of timer0, timer1, ... for alert texts.")
@click.option("--comm-phases", metavar="LIST", help="Phases that time communication (default: from streams).")
@click.option(
    "--set", "sets", multiple=True, metavar="NAME=VALUE", help="Override a threshold (docs/diagnosis.md)."
)
@click.option("-q", "--quiet", is_flag=True, help="Do not print alert transitions.")
def aggregate_cmd(
    redis_url: str,
    jobs: Tuple[str, ...],
    group: str,
    consumer: Optional[str],
    lease: float,
    shard: Optional[str],
    duration: Optional[float],
    phases: Optional[str],
    comm_phases: Optional[str],
    sets: Tuple[str, ...],
    quiet: bool,
) -> int:
    """Diagnose jobs live: read summaries from Redis, publish alerts (stream, channel, state).

    Reads each job's summaries through a consumer group (a restarted aggregator resumes where it
    stopped; of several, one leads each job and the others stand by to take over), aligns ranks
    per step, runs every diagnosis level and writes each alert transition to argus:{JOB}:alerts
    (stream and pub/sub channel) and the current state to argus:{JOB}:alert_state. Credentials:
    ARGUS_REDIS_PASSWORD(_FILE), never in the URL.

    A job too large for one aggregator (one does ~10,000 summaries/s: docs/benchmarks.md) is split
    with --shard I/N over N aggregators started alike: ranks go to shards by host and
    communicator (docs/architecture.md, "One job over several aggregators"), each member judges
    one shard, one of them the whole job's step time and hangs; when one dies another takes its
    shard over, with the summaries it had not judged, after --lease.

    \b
    Examples:
      argus aggregate --redis redis://127.0.0.1:6379/0
      argus aggregate --redis redis://127.0.0.1:6379/0 --consumer standby-1   # a second one, on standby
      argus aggregate --redis redis://10.0.0.5:6379/0 --job run-42 --phases fwd,bwd,opt,grad_sync
      argus aggregate --redis redis://10.0.0.5:6379/0 --job big-1 --shard 0/4   # one of four, then 1/4 ...
    """
    import signal

    from argus.aggregator.service import Aggregator
    from argus.gctune import tune_gc

    tune_gc()
    try:
        th = Thresholds.from_pairs(list(sets))
    except ValueError as e:
        raise UsageError(str(e), "see docs/diagnosis.md for the thresholds") from None
    info = PhaseInfo.parse(phases, comm_phases)
    engine = Engine(th, info)
    split = None
    if shard is not None:
        from argus.aggregator.partition import parse_shard

        split = parse_shard(shard)
        if lease <= 0:
            raise UsageError(
                "--shard needs a lease (--lease > 0): the members take a dead one's shard over by it",
                "e.g. --shard 0/2 --lease 10",
            )

    def show(a: object) -> None:
        if not quiet:
            click.echo(  # the job too: one aggregator serves every job in argus:jobs by default
                f"{a.state.upper():8} {a.kind:18} job {a.job} ranks {a.ranks} steps {a.steps}: {a.summary}"  # type: ignore[attr-defined]
            )

    if split is not None:
        return _members(
            redis_url, split, th, info, list(jobs) or None, group, consumer, lease, duration, show
        )

    agg = Aggregator(
        _client(redis_url),
        engine,
        list(jobs) or None,
        group,
        consumer,
        on_alert=show,
        on_notice=lambda line: click.echo(line, err=True),
        lease_s=lease if lease > 0 else None,
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    click.echo(
        f"Aggregating {', '.join(jobs) if jobs else 'every job in argus:jobs'} as consumer of group {group}. "
        "Hit Ctrl-C to end.",
        err=True,
    )
    try:
        with _redis_errors(redis_url):
            st = agg.run(duration, lambda: stop["now"])
    except KeyboardInterrupt:
        st = agg.stats
    click.echo(
        f"{st.entries} summaries, {st.heartbeats} heartbeats, {st.published} alert transitions; "
        f"{agg.engine.stats.late_dropped} summaries came after their step was judged (left out); "
        f"{st.cpu_s:.1f} s CPU ({st.entries / st.cpu_s if st.cpu_s else 0:.0f} summaries/s)",
        err=True,
    )
    return 0


def _members(
    redis_url: str,
    split: Tuple[int, int],
    th: Thresholds,
    info: PhaseInfo,
    jobs: Optional[List[str]],
    group: str,
    consumer: Optional[str],
    lease: float,
    duration: Optional[float],
    show: Any,
) -> int:
    """`argus aggregate --shard I/N`: member I of N (argus.aggregator.sharded)."""
    import signal

    from argus.aggregator.sharded import Member

    i, n = split
    member = Member(
        _client(redis_url),
        i,
        n,
        th,
        info,
        jobs,
        group,
        consumer,
        lease_s=lease,
        on_alert=show,
        on_notice=lambda line: click.echo(line, err=True),
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    click.echo(
        f"Aggregating {', '.join(jobs) if jobs else 'every job in argus:jobs'} as member {i} of {n} "
        f"(consumer {member.consumer}). Hit Ctrl-C to end.",
        err=True,
    )
    try:
        with _redis_errors(redis_url):
            st = member.run(duration, lambda: stop["now"])
    except KeyboardInterrupt:
        st = member.stats
    click.echo(
        f"{st.routed} summaries routed, {st.entries} judged in shard(s) "
        f"{','.join(map(str, sorted(st.by_shard))) or '-'}, {st.reduced} steps reduced, "
        f"{st.published} alert transitions; {st.cpu_s:.1f} s CPU (route {st.cpu_route_s:.1f}, "
        f"shards {st.cpu_shard_s:.1f}, reduce {st.cpu_reduce_s:.1f}, plan {st.cpu_plan_s:.1f})",
        err=True,
    )
    return 0


def _since(text: Optional[str]) -> int:
    """'10m', '2h', '30s' ago, or an absolute unix time in seconds -> realtime ns."""
    import time as _time

    if not text:
        return 0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1] in units:
            return int((_time.time() - float(text[:-1]) * units[text[-1]]) * 1e9)
        return int(float(text) * 1e9)
    except ValueError:
        raise UsageError(f"--since '{text}' is not a duration or a unix time", "e.g. --since 30m") from None


def _line(a: object, as_json: bool) -> str:
    from argus.aggregator.alerts import Alert

    assert isinstance(a, Alert)
    if as_json:
        return json.dumps(a.to_json(), separators=(",", ":"))
    where = f"ranks {a.ranks} steps {a.steps[0]}-{a.steps[1]}"
    return f"{a.state.upper():8} [{a.severity}] {a.kind} {where}: {a.summary}"


@click.command("alerts")
@click.option(
    "--redis", "redis_url", required=True, metavar="URL", help="Where the aggregators write alerts."
)
@click.option("--job", "jobs", multiple=True, help="This job only (repeatable; default: every job).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new transitions as they happen.")
@click.option("-j", "--json", "as_json", is_flag=True, help="One JSON object per alert (DESIGN §8 fields).")
@click.option(
    "--since", metavar="T", help="Transitions since T (30m, 2h, or a unix time) instead of the current state."
)
@click.option("--webhook", metavar="URL", help="Also POST each alert (Alertmanager JSON) here, with retries.")
def alerts_cmd(
    redis_url: str,
    jobs: Tuple[str, ...],
    follow: bool,
    as_json: bool,
    since: Optional[str],
    webhook: Optional[str],
) -> int:
    """Show a job's alerts: the current state, transitions since a time, or follow them live.

    \b
    Examples:
      argus alerts --redis redis://127.0.0.1:6379/0
      argus alerts --redis redis://127.0.0.1:6379/0 --job run-42 --since 2h --json
      argus alerts --redis redis://127.0.0.1:6379/0 --follow --webhook http://alertmanager:9093/api/v2/alerts
    """
    from argus.aggregator.webhook import Webhook

    client = _client(redis_url)
    hook = None
    if webhook:
        try:
            hook = Webhook(webhook, say=lambda m: click.echo(f"warning: {m}", err=True))
        except ValueError as e:
            raise UsageError(str(e), "e.g. --webhook http://alertmanager:9093/api/v2/alerts") from None
    with _redis_errors(redis_url):
        return _show_alerts(client, list(jobs), follow, as_json, since, hook)


def _show_alerts(
    client: Any, jobs: List[str], follow: bool, as_json: bool, since: Optional[str], hook: Any
) -> int:
    from argus.aggregator import service
    from argus.rediskeys import list_jobs

    names = jobs or list_jobs(client)
    shown = []
    for job in names:
        got = (
            [a for _id, a in service.history(client, job, _since(since))]
            if since
            else service.current(client, job)
        )
        for a in got:
            click.echo(_line(a, as_json))
        shown += got
    if hook is not None and shown:
        hook.post(shown)
    if not follow:
        return 0
    if len(names) != 1:
        shown_jobs = ", ".join(names[:8]) or "none yet"
        raise UsageError(
            f"--follow follows one job; this Redis has: {shown_jobs}",
            "e.g. argus alerts --follow --job run-42",
        )
    try:
        for _eid, new in service.follow(client, names[0]):
            if new is None:
                continue
            click.echo(_line(new, as_json))
            if hook is not None:
                hook.post([new])
    except KeyboardInterrupt:
        pass
    return 0
