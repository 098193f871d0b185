"""`argus demo`: all of Argus in one command, on the simulated job.

Starts a private Redis (unless --redis is given), an 8-rank simulated job with a straggler that
appears mid-run, the agent (`argus probe --redis`), the aggregator (`argus aggregate`) and the live
view (`argus top`) for about a minute; then prints the diagnosis and writes a report picture.
Every process it started is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import click

from argus.errors import EnvironmentProblem, PermissionDenied
from argus.sim.launcher import SimConfig, SimJob, child_pythonpath


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """Children started by the demo; all stopped by close()."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []

    def start(self, args: List[str], **kw: object) -> subprocess.Popen:
        p = subprocess.Popen(args, start_new_session=True, **kw)  # type: ignore[call-overload]
        self.procs.append(p)
        return p

    def close(self) -> None:
        """Stop them all at once, within 10 s: the agent's own shutdown (detaching its probes) takes
        seconds on a loaded host, and one after the other they once took over a minute after Ctrl-C."""
        live = [p for p in reversed(self.procs) if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)


def _exit_soon(procs: List[subprocess.Popen], after_s: float = 20.0) -> None:
    """After Ctrl-C the person gets the prompt back within `after_s` whatever the cleanup waits on:
    then every child's process group is killed and the demo exits (130)."""

    def watchdog() -> None:
        time.sleep(after_s)
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os._exit(130)

    threading.Thread(target=watchdog, daemon=True).start()


def argus(*args: str) -> List[str]:
    return [sys.executable, "-m", "argus", *args]


def child_env() -> Dict[str, str]:
    """The environment of the commands the demo starts: they run this argus (the checkout's or the
    installed one), from the demo's own directory, not from wherever the demo was started. They
    read no config file and no ARGUS_<COMMAND>_<OPTION> variable: the demo is the same everywhere,
    whatever a site set for its real jobs (argus/conffile.py)."""
    from argus.cli import cli

    site = {p.envvar for c in cli.commands.values() for p in _all_params(c) if isinstance(p.envvar, str)}
    env = {k: v for k, v in os.environ.items() if k not in site}
    return dict(env, PYTHONPATH=child_pythonpath(), ARGUS_CONFIG="")


def _all_params(cmd: click.Command) -> List[click.Parameter]:
    out = list(cmd.params)
    if isinstance(cmd, click.Group):
        for c in cmd.commands.values():
            out += _all_params(c)
    return out


def start_redis(ps: Processes, workdir: Path) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise EnvironmentProblem(
            "redis-server is not installed", "sudo scripts/setup.sh, or pass --redis URL"
        )
    port = free_port()
    ps.start(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
            return f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    raise EnvironmentProblem("the private redis-server did not start", "check `redis-server --version`")


@click.command("demo")
@click.option(
    "--redis", "redis_url", default=None, metavar="URL", help="Use this Redis instead of a private one."
)
@click.option("--ranks", default=8, show_default=True, help="Ranks of the simulated job.")
@click.option("--seconds", default=60.0, show_default=True, help="How long the job runs.")
@click.option("--straggler", default=3, show_default=True, help="Rank that slows down mid-run.")
@click.option("--factor", default=1.5, show_default=True, help="How much slower its kernels become.")
@click.option("--no-tui", is_flag=True, help="No live view: print alert transitions as they happen.")
@click.option(
    "-o",
    "--report",
    "report_path",
    default=None,
    help="Where the report picture goes (default: report.png in the demo's run directory).",
)
def demo_cmd(
    redis_url: Optional[str],
    ranks: int,
    seconds: float,
    straggler: int,
    factor: float,
    no_tui: bool,
    report_path: Optional[str],
) -> int:
    """Run all of Argus on a simulated 8-rank job with a straggler appearing mid-run.

    Nothing to set up beyond `sudo scripts/setup.sh`: it starts a private Redis, the job, the
    agent, the aggregator and the live view, then prints the diagnosis and writes a report.

    \b
    Examples:
      sudo argus demo
      sudo argus demo --no-tui --seconds 30
      sudo argus demo --straggler 5 --factor 2 -o /tmp/report.png
    """
    if os.geteuid() != 0:
        raise PermissionDenied("the demo attaches eBPF probes: it needs root", "sudo argus demo")
    step_s = 0.18
    steps = max(30, int(seconds / step_s))
    onset = max(10, steps // 3)
    workdir = Path(tempfile.mkdtemp(prefix="argus-demo-"))
    # absolute: the commands below run in workdir
    report_path = str(Path(report_path).resolve()) if report_path else str(workdir / "report.png")
    env = child_env()
    ps = Processes()
    job: Optional[SimJob] = None
    try:
        url = redis_url or start_redis(ps, workdir)
        spec = f"straggler:rank={straggler},factor={factor},from_step={onset}"
        job = SimJob(
            SimConfig(
                timers=True, ranks=ranks, steps=steps, injects=[spec], gate=True, run_dir=str(workdir / "job")
            )
        )
        name = f"sim-{job.run_id}"
        click.echo(
            f"argus demo: {ranks}-rank simulated job {name}, {steps} steps (~{steps * step_s:.0f} s); "
            f"rank {straggler} becomes {factor}× slower at step {onset}"
        )
        click.echo(f"  redis {url}; logs and ground truth in {workdir}")
        job.start()
        job.wait_loaded()
        probe_log = open(workdir / "probe.log", "w")
        pargs = ["probe", "--redis", url, "-i", "0.25s"]
        for pid in job.pids.values():
            pargs += ["-p", str(pid)]
        probe = ps.start(
            argus(*pargs), stdout=subprocess.DEVNULL, stderr=probe_log, cwd=str(workdir), env=env
        )
        _wait_text(workdir / "probe.log", "Tracing", probe, 60)
        agg_log = open(workdir / "aggregate.log", "w")
        ps.start(
            argus(
                "aggregate", "--redis", url, "--job", name, "--phases", "forward,backward,optimizer,grad_sync"
            ),
            stdout=agg_log,
            stderr=subprocess.STDOUT,
            cwd=str(workdir),
            env=env,
        )
        job.release()
        click.echo("  agent attached before the first CUDA call; aggregator running")
        if no_tui or not sys.stdout.isatty():
            _follow_alerts(job, url, name)
        else:
            _tui(job, url, name, ranks)
        job.wait()
        time.sleep(2.0)  # let the agent flush and the aggregator catch up
        click.echo("\n=== diagnosis (argus diagnose) ===")
        subprocess.run(
            argus(
                "diagnose", "--redis", url, "--job", name, "--phases", "forward,backward,optimizer,grad_sync"
            ),
            cwd=str(workdir),
            env=env,
        )
        res = subprocess.run(
            argus("report", "--redis", url, "--job", name, "-o", report_path),
            cwd=str(workdir),
            env=env,
            capture_output=True,
            text=True,
        )
        click.echo(res.stdout.strip() or res.stderr.strip())
        click.echo(f"report: {report_path}   (ground truth: {job.run_dir}/truth.json)")
        job.write_outputs(None, None)
        return 0
    except KeyboardInterrupt:
        click.echo("\ninterrupted: stopping everything the demo started", err=True)
        _exit_soon([*ps.procs, *(job.procs.values() if job is not None else [])])
        return 130
    finally:
        if job is not None:
            job.stop()
        ps.close()


def _wait_text(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        if proc.poll() is not None:
            raise EnvironmentProblem(
                f"the agent exited: {path.read_text().strip().splitlines()[-1:]}", "run `sudo argus doctor`"
            )
        time.sleep(0.1)
    raise EnvironmentProblem("the agent did not attach in time", f"see {path}")


def _follow_alerts(job: SimJob, url: str, name: str) -> None:
    from argus.tui.feed import Feed
    from argus.tui.top import connect

    feed = Feed(connect(url), name)
    seen: set = set()
    last_print = 0.0
    while any(p.poll() is None for p in job.procs.values()):
        feed.poll(block_ms=500)
        job.poll()
        snap = feed.snapshot()
        for a in snap.alerts:
            if a["id"] not in seen:
                seen.add(a["id"])
                click.echo(
                    f"  ALERT {a['kind']} ranks {a['ranks']} (steps {a['steps'][0]}-{a['steps'][1]}): "
                    f"{a.get('summary', '')}"
                )
        if time.monotonic() - last_print > 5 and snap.step_times:
            last_print = time.monotonic()
            firing = ", ".join(f"{a['kind']} {a['ranks']}" for a in snap.alerts) or "none"
            click.echo(
                f"  step {snap.step}: job step time {snap.step_times[-1] * 1e3:.0f} ms; "
                f"{snap.ranks_seen} ranks reporting; alerts firing: {firing}"
            )


def _tui(job: SimJob, url: str, name: str, ranks: int) -> None:
    from rich.console import Console
    from rich.live import Live

    from argus.tui.draw import ViewOptions, render
    from argus.tui.feed import Feed
    from argus.tui.top import connect

    feed = Feed(connect(url), name, expected=ranks)
    with Live(console=Console(), screen=False, auto_refresh=False) as live:
        while any(p.poll() is None for p in job.procs.values()):
            feed.poll(block_ms=500)
            job.poll()
            live.update(render(feed.snapshot(), ViewOptions()), refresh=True)
