"""Overhead on a real PyTorch training loop (CPU): `argus probe` vs torch.profiler vs py-spy.

    sudo .venv/bin/python -m benchmarks.torch_overhead [--quick] [--rounds 4] [--steps 60] [--ranks 2]

The job: benchmarks/torch_train.py — a 2-layer TransformerEncoder (d 128, 4 heads, vocab 1000,
batch 8 × 64 tokens) trained with DistributedDataParallel over gloo, one process per rank started
torchrun-style (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), one intra-op thread per rank.
Each run: start the ranks, 5 warm-up steps, the ranks wait at a gate while the observer attaches,
then N timed steps. Conditions, interleaved (every round runs each once, order rotated):

  off           nothing attached
  argus         `argus probe -p RANK0 -p RANK1 --json`, the defaults: every channel that applies (a
                CPU PyTorch process maps no libcuda/libnccl: the Python channel at 49 Hz, plus GC
                pauses from CPython's USDT probes when the interpreter has them)
  argus+host    the same with the opt-in host channel (--host-channel: 19 Hz native stacks and
                off-CPU time with native stacks at every switch-out)
  torch.profiler  in-process, ProfilerActivity.CPU around the timed steps, trace exported after
  torch.profiler+stacks  the same with with_stack=True
  py-spy        `py-spy record --rate 49 --format raw` per rank (the same sampling rate as argus)

Columns: median step time (median over rounds of each run's median, steps averaged over ranks) and
its ratio to `off`; peak RSS of the training processes (max over ranks of ru_maxrss) and of the
observer processes (VmHWM, summed over observer processes); observer CPU; bytes the tool produced
per rank per step (argus: its --json output; torch.profiler: the exported Chrome trace; py-spy:
its folded-stack output).

The ranks run under a Python that py-spy can read: py-spy 0.4 cannot find the version of Debian's
stripped /usr/bin/python3.11 ("Failed to find python version from target process"), so by default
a venv from pyenv's 3.11 with torch==2.13.0 is made once in ~/.cache/argus/ (--python overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks._util import REPO, Observer, machine, med, need_root, spread

TRAIN = REPO / "benchmarks" / "torch_train.py"
TORCH = "torch==2.13.0"
CONDITIONS = ["off", "argus", "argus+host", "torch.profiler", "torch.profiler+stacks", "py-spy"]
# (the defaults leave the host channel off; argus+host turns it on)
ARGUS_VARIANTS = {"argus": [], "argus+host": ["--host-channel"]}
HZ = 49


def trainer_python(explicit: Optional[str]) -> str:
    """A Python with torch for the ranks (made once from pyenv 3.11 when there is one)."""
    if explicit:
        return explicit
    pyenv = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))) / "versions"
    found = sorted(pyenv.glob("3.11.*/bin/python3.11"))
    if not found:
        return sys.executable
    base = found[-1]
    venv = Path.home() / ".cache" / "argus" / f"bench-torch-{base.parent.parent.name}"
    py = venv / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode == 0
    if not ok:
        print(f"making {venv} (pyenv {base.parent.parent.name} + {TORCH}) ...", file=sys.stderr, flush=True)
        subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", TORCH], check=True)
    return str(py)


def py_spy() -> Optional[str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return spy if Path(spy).exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(py: str, d: Path, ranks: int, args: List[str], **env: str) -> List[subprocess.Popen]:
    """The ranks of benchmarks/torch_train.py (args: WARMUP STEPS PROFILER), torchrun-style env,
    logs in d/rank<R>.log; `env` adds variables."""
    port = free_port()
    procs = []
    for r in range(ranks):
        renv = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            TORCHELASTIC_RUN_ID=f"bench-{port}",
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
            **env,
        )
        with open(d / f"rank{r}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [py, str(TRAIN), str(d), *args], env=renv, stdout=log, stderr=subprocess.STDOUT
                )
            )
    return procs


def wait_ready(d: Path, procs: List[subprocess.Popen], timeout: float = 300) -> None:
    """Until every rank has done its warm-up and waits at the gate."""
    deadline = time.monotonic() + timeout
    while not all((d / f"ready{r}").exists() for r in range(len(procs))):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"ranks failed: {(d / 'rank0.log').read_text()[-2000:]}")
        time.sleep(0.05)


def run_one(py: str, cond: str, ranks: int, warmup: int, steps: int) -> Dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="argus-torch-") as tmp:
        d = Path(tmp)
        prof = {"torch.profiler": "torch", "torch.profiler+stacks": "torch-stacks"}.get(cond, "none")
        procs = start_ranks(py, d, ranks, [str(warmup), str(steps), prof])
        observers: List[Observer] = []
        out: Dict[str, float] = {}
        try:
            wait_ready(d, procs)
            pids = [p.pid for p in procs]
            if cond in ARGUS_VARIANTS:
                argv = [
                    sys.executable,
                    "-m",
                    "argus",
                    "probe",
                    "--json",
                    "--no-gpu-metrics",
                    *ARGUS_VARIANTS[cond],
                ]
                for pid in pids:
                    argv += ["-p", str(pid)]
                observers.append(Observer(argv, d / "argus.jsonl", ready="Tracing"))
                out["ready_s"] = observers[0].wait_ready()
            elif cond == "py-spy":
                spy = py_spy()
                assert spy is not None
                for r, pid in enumerate(pids):
                    argv = [spy, "record", "--pid", str(pid), "--rate", str(HZ), "--format", "raw"]
                    observers.append(Observer([*argv, "--output", str(d / f"spy{r}.txt")]))
                time.sleep(2.0)  # py-spy prints its banner only to a terminal: give it time to attach
                for o in observers:
                    if o.p.poll() is not None:
                        raise RuntimeError(f"py-spy exited: {''.join(o.err)[-1500:]}")
            for o in observers:
                o.mark()
            (d / "go").write_text("go")
            while any(p.poll() is None for p in procs):
                for o in observers:
                    o.touch()
                time.sleep(0.2)
            for p in procs:
                if p.returncode != 0:
                    raise RuntimeError(f"rank exited {p.returncode}: {(d / 'rank0.log').read_text()[-2000:]}")
            if observers:
                out["cpu"] = sum(o.cpu_share() for o in observers)
                for o in observers:
                    o.wait(timeout=120)
                out["obs_rss_mb"] = sum(o.hwm_kb for o in observers) / 1024
                observers = []
            res = [json.loads((d / f"result{r}.json").read_text()) for r in range(ranks)]
            per_step = [sum(x) / len(x) for x in zip(*(r["times"] for r in res))]
            out["step"] = med(per_step)
            out["rss_mb"] = max(r["maxrss_kb"] for r in res) / 1024
            if cond in ARGUS_VARIANTS:
                produced = (d / "argus.jsonl").stat().st_size
            elif cond == "py-spy":
                produced = sum(
                    (d / f"spy{r}.txt").stat().st_size for r in range(ranks) if (d / f"spy{r}.txt").exists()
                )
            else:
                produced = sum(r["trace_bytes"] for r in res)
            out["bytes_per_rank_step"] = produced / ranks / steps
            return out
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for o in observers:
                o.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, 8 steps")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--python", help="interpreter of the ranks (needs torch)")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    a = ap.parse_args()
    if not need_root("torch_overhead"):
        return 3
    rounds, steps = (1, 8) if a.quick else (a.rounds, a.steps)
    conds = [c for c in a.conditions.split(",") if c]
    if "py-spy" in conds and py_spy() is None:
        print("note: no py-spy (pip install py-spy): its row is skipped")
        conds.remove("py-spy")
    py = trainer_python(a.python)
    ver = subprocess.run(
        [py, "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(f"# real PyTorch training loop on CPU: {a.ranks} ranks over gloo\n")
    print(f"{machine()}\n")
    print(
        f"ranks: {py} (Python/torch {ver}); {rounds} round(s) × {len(conds)} conditions, interleaved, "
        f"{a.warmup} warm-up + {steps} timed steps per run; cell = median over rounds of each run's "
        f"median step time\n"
    )
    res: Dict[str, List[Dict[str, float]]] = {c: [] for c in conds}
    t0 = time.monotonic()
    for r in range(rounds):
        order = conds[r % len(conds) :] + conds[: r % len(conds)]
        for c in order:
            res[c].append(run_one(py, c, a.ranks, a.warmup, steps))
            print(f"  round {r} {c}: {res[c][-1]}", file=sys.stderr, flush=True)
    base = med([x["step"] for x in res["off"]]) if "off" in res else float("nan")
    print(
        "| condition | median step (ms) | runs (ms) | step-time ratio | training peak RSS (MB) "
        "| observer peak RSS (MB) | observer CPU (% of a core) | bytes per rank per step |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    meds = {}
    for c in conds:
        xs = [x["step"] for x in res[c]]
        meds[c] = med(xs)

        def col(k: str, f: str, rows: List[Dict[str, float]] = res[c]) -> str:
            return f.format(med([x[k] for x in rows])) if k in rows[0] else "—"

        print(
            f"| {c} | {1e3 * meds[c]:.1f} | {spread([1e3 * x for x in xs], '{:.1f}')} | {meds[c] / base:.4f} "
            f"| {col('rss_mb', '{:.0f}')} | {col('obs_rss_mb', '{:.0f}')} "
            f"| {col('cpu', '{:.1%}')} | {col('bytes_per_rank_step', '{:,.0f}')} |"
        )
    if "argus" in meds:
        print()
        for other in ("torch.profiler", "torch.profiler+stacks", "py-spy"):
            if other in meds:
                a_ov, o_ov = meds["argus"] / base - 1, meds[other] / base - 1
                print(
                    f"- argus vs {other}: step time argus/{other} = {meds['argus'] / meds[other]:.4f}; "
                    f"overhead {a_ov:+.2%} vs {o_ov:+.2%}"
                )
        print(f"\nargus overhead on this loop: {meds['argus'] / base - 1:+.2%} (target < 1%)")
    print(f"\n(took {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
