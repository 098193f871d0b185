"""`argus sim`: run the simulated multi-rank training job (no GPU needed)."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Tuple

import click

from argus.errors import UsageError
from argus.sim.faults import KINDS
from argus.sim.launcher import LAYOUTS, SimConfig, SimJob
from argus.sim.workload import PRESETS, predict_step_s

FAULT_HELP = "\n".join(f"  {k}:{v}" for k, v in KINDS.items())


@click.group("sim")
def sim_group() -> None:
    """The simulated GPU training job: stand-in libcuda.so.1/libnccl.so.2 and multi-rank trainers.

    \b
    Examples:
      argus sim run --ranks 8 --steps 50 --inject straggler:rank=3,factor=1.5
      argus sim build            # compile the simulated libraries and print where they are
    """


@sim_group.command("build")
@click.option("--force", is_flag=True, help="Rebuild even if the sources are unchanged.")
def build_cmd(force: bool) -> None:
    """Compile the simulated libcuda.so.1 and libnccl.so.2 into the cache and print their paths.

    \b
    Examples:
      argus sim build
      argus sim build --force
    """
    from argus.sim.build import build

    libs = build(force=force)
    click.echo(f"libcuda.so.1  {libs.libcuda}\nlibnccl.so.2  {libs.libnccl}")


def _parse_sets(sets: Tuple[str, ...]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for s in sets:
        k, eq, v = s.partition("=")
        if not eq:
            raise UsageError(f"--set '{s}' is not key=value", "e.g. --set layers=12 --set data_ms=30")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise UsageError(f"--set {k}: '{v}' is not a number", "e.g. --set layers=12") from None
    return out


def _host_names(text: str) -> List[str]:
    names = [h.strip() for h in text.split(",") if h.strip()]
    for h in names:
        if len(h) > 64 or not all(c.isalnum() or c in "-_." for c in h):
            raise UsageError(
                f"--hosts: '{h[:64]}' is not a host name", "letters, digits, - _ . ; e.g. --hosts vm-a,vm-b"
            )
    return names


@sim_group.command("run", epilog=f"\b\nFault kinds (--inject KIND:key=value,...):\n{FAULT_HELP}")
@click.option("-n", "--ranks", default=8, show_default=True, help="Number of rank processes.")
@click.option("-s", "--steps", default=50, show_default=True, help="Training steps per rank.")
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="dp",
    show_default=True,
    help="Parallel layout: data, tensor+data, or pipeline+data parallel.",
)
@click.option("--inject", "injects", multiple=True, metavar="SPEC", help="Inject a fault (repeatable).")
@click.option(
    "--preset",
    type=click.Choice(list(PRESETS)),
    default="default",
    show_default=True,
    help="Workload rates: default (~0.2 s steps, ~490 launches), heavy (>2,000 launches), small; "
    "tp (with --layout tp-dp: a TP=8 x PP=2 Megatron rank, >10,000 launches, >3,000 collectives).",
)
@click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a workload setting (repeatable)."
)
@click.option(
    "--ranks-per-host",
    default=8,
    show_default=True,
    help="Ranks per simulated host (links between hosts are slower).",
)
@click.option(
    "--hosts",
    "hosts",
    default="",
    metavar="NAME[,NAME...]",
    help="Names of the simulated hosts, in order (default: node-0, node-1, ...); e.g. "
    "--hosts $(hostname) on a machine that runs one job of its own.",
)
@click.option(
    "--python", "python", default=None, help="Interpreter for the rank processes (default: this one)."
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where logs and truth go (default: a new /tmp/argus-sim-* directory).",
)
@click.option(
    "--truth",
    type=click.Path(dir_okay=False),
    default=None,
    help="Ground-truth JSON path (default: RUN_DIR/truth.json).",
)
@click.option(
    "--json-steps",
    type=click.Path(dir_okay=False),
    default=None,
    help='Write measured step times: {"step_seconds": [...], "ranks": {rank: [...]}}.',
)
@click.option(
    "--hang-hold", default=10.0, show_default=True, help="Seconds to keep a hung job hung before killing it."
)
@click.option(
    "--timers/--no-timers",
    default=False,
    show_default=True,
    help="Megatron-style CUDA-event timers (forward, backward, optimizer, grad_sync) read with "
    "cuEventElapsedTime; without (the default): a stock PyTorch DDP job, no timers.",
)
@click.option(
    "--nccl-timing",
    is_flag=True,
    help="Set TORCH_NCCL_ENABLE_TIMING=1 for every rank: ProcessGroupNCCL's start events and its "
    "watchdog's cuEventElapsedTime reads.",
)
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds.")
@click.option("-q", "--quiet", is_flag=True, help="Only the final summary.")
def run_cmd(
    ranks: int,
    steps: int,
    layout: str,
    injects: Tuple[str, ...],
    preset: str,
    sets: Tuple[str, ...],
    ranks_per_host: int,
    hosts: str,
    python: Optional[str],
    run_dir: Optional[str],
    truth: Optional[str],
    json_steps: Optional[str],
    hang_hold: float,
    timers: bool,
    nccl_timing: bool,
    timeout: Optional[float],
    quiet: bool,
) -> None:
    """Run an N-rank simulated training job, optionally with injected faults.

    Each rank is a Python process driving the simulated libcuda.so.1 and libnccl.so.2 exactly
    as a framework drives NVIDIA's: attach `argus probe` to its pids to trace it. Prints step
    times as it goes and writes the ground truth (what was injected, where, from which step).

    \b
    Examples:
      argus sim run --ranks 8 --steps 50 --inject straggler:rank=3,factor=1.5
      argus sim run --layout pp-dp --inject bubble:rank=1,factor=1.9,from_step=10
      argus sim run --layout tp-dp --preset heavy --steps 20
      argus sim run --layout tp-dp --preset tp --steps 5
      argus sim run --inject slow_link:ranks=2-3,factor=4 --json-steps steps.json
      argus sim run --ranks 8 --ranks-per-host 4 --nccl-timing
      ARGUS_SIM_NET=ib argus sim run --ranks 8 --ranks-per-host 4   # the IB plugin's sends
    """
    cfg = SimConfig(
        ranks=ranks,
        steps=steps,
        layout=layout,
        injects=list(injects),
        preset=preset,
        overrides=_parse_sets(sets),
        ranks_per_host=ranks_per_host,
        host_names=_host_names(hosts),
        run_dir=run_dir,
        hang_hold_s=hang_hold,
        timeout_s=timeout,
        timers=timers,
        nccl_timing=nccl_timing,
    )
    if python:
        cfg.python = python
    job = SimJob(cfg)
    fault_txt = "; ".join(f.spec for f in job.faults) or "none"
    click.echo(
        f"argus sim: {ranks} ranks ({layout}), {steps} steps, preset {preset}; faults: {fault_txt}"
        + ("" if timers else "; no timers")
        + ("; TORCH_NCCL_ENABLE_TIMING=1" if nccl_timing else "")
    )
    click.echo(f"run dir: {job.run_dir}")
    job.start()
    click.echo(f"rank pids: {' '.join(f'{r}:{p}' for r, p in job.pids.items())}")
    every = max(1, steps // 10)
    shown = [0]

    def progress(j: SimJob) -> None:
        done = j.steps_done()
        if quiet or done <= shown[0]:
            return
        times = j.job_step_seconds()
        while shown[0] + every <= done or (done == steps and shown[0] < done):
            shown[0] = min(done, shown[0] + every)
            i = shown[0] - 1
            click.echo(f"  step {shown[0]:>4}/{steps}: {times[i]:.3f} s (max over ranks)")

    job.wait(progress)
    tp = job.write_outputs(truth, json_steps)
    _summary(job, tp)


def _summary(job: SimJob, truth_path: object) -> None:
    per = job.step_seconds()
    times = job.job_step_seconds()
    if job.hung:
        hung = [r for r, rs in job.ranks.items() if rs.hang]
        first = job.ranks[hung[0]].hang or {}
        click.echo(
            f"hang: rank(s) {hung} stopped at DP collective "
            f"{first.get('dp_seq')}; the job was held {job.cfg.hang_hold_s:.0f} s, then killed"
        )
    click.echo(f"completed {len(times)} steps; per-rank mean step time:")
    click.echo("  rank  mean s   max s")
    for r, v in per.items():
        if v:
            click.echo(f"  {r:>4}  {statistics.fmean(v):.3f}   {max(v):.3f}")
    onsets = [f.step if f.step >= 0 else f.from_step for f in job.faults]
    skip = min(2, len(times))  # warm-up steps
    base = predict_step_s(job.w, job.cfg.layout, job.cfg.ranks).total
    modelled = {"straggler", "masked_straggler", "bubble"}
    model = f"model: {base:.3f} s"
    if any(f.kind in modelled for f in job.faults):
        model += f" -> {_predicted(job):.3f} s with the fault"
    if times and job.faults and min(onsets) > skip:
        before, after = times[skip : min(onsets)], times[min(onsets) + 1 :]
        after_txt = f"{statistics.fmean(after):.3f} s" if after else "n/a"
        click.echo(
            f"job step time: {statistics.fmean(before):.3f} s before onset (step {min(onsets)}), "
            f"{after_txt} after; {model}"
        )
    elif times:
        click.echo(f"job step time: {statistics.fmean(times[skip:] or times):.3f} s mean; {model}")
    click.echo(f"ground truth: {truth_path}")


def _predicted(job: SimJob) -> float:
    cf = mf = bf = 1.0
    for f in job.faults:
        if f.kind == "straggler":
            cf = max(cf, f.factor)
        elif f.kind == "masked_straggler":
            mf = max(mf, f.factor)
        elif f.kind == "bubble":
            bf = max(bf, f.factor)
    return predict_step_s(job.w, job.cfg.layout, job.cfg.ranks, cf, mf, bf).total


__all__: List[str] = ["sim_group"]
