"""Step-time overhead on the simulated 8-rank job: nothing attached, `argus probe` with each channel
alone and all together, and a bpftrace one-liner on the same uprobes as a floor — interleaved.

    sudo .venv/bin/python -m benchmarks.sim_overhead [--quick] [--rounds 3] [--steps 40] [--ranks 8]

Settings: the default preset (data parallel, ~490 launches and 24 all-reduces per rank per step)
and the heavy one (tensor+data parallel, >= 2,000 launches and >= 200 collectives per rank per
step); `--settings launch-bound` the heavy preset's launches data parallel with a launch queue of
1,024 (the hosts wait in launches for their GPUs; argus keeps its launch probes on); `--settings tp`
runs the tp preset (a TP=8 x PP=2 Megatron-style rank: 10,267 launches and
3,240 collectives per rank per step, 1.6 s steps; argus/sim/workload.py). Every run starts a
fresh 8-rank job that waits at a gate until the observer is attached, so every step of every run
is observed. In each round every condition runs once, in an order
rotated by round; a condition's number is the median over rounds of the run's median step time
(steps 3..N). After each run the benchmark waits until the observer's uprobes are gone (argus
removes them in a detached child) so no run pays for the previous one.

Conditions:
  off      nothing attached
  cuda     argus probe --no-nccl --no-python --no-host     (libcuda's uprobes and uretprobes; the
           ones on launches attached 3 steps in 30)
  nccl     argus probe --no-cuda --no-python --no-host     (libnccl)
  python   argus probe --no-cuda --no-nccl --no-host       (49 Hz stack sampler + sched_switch walks)
  python+host  argus probe --no-cuda --no-nccl --host-channel  (+ 19 Hz native stacks, off-CPU time;
           `argus probe` refuses the host channel alone: "--no-cuda, --no-cudart and --no-nccl leave
           nothing to probe")
  all      argus probe                                     (the defaults: every channel that applies
           but the opt-in host channel; launches probed 3 steps in 30)
  all-launches  argus probe --launch-steps all             (the same, launches probed at every step)
  bpftrace bpftrace: a count() per probe on the same attach points as argus's cuda channel,
           launches at every step (libcuda only: see bpftrace_program) — the floor for probing
           every call
  all-baseline  with --baseline-tree TREE: `all` run from another checkout (an older version, a
           git worktree), interleaved in the same rounds: a change measured against its baseline
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from benchmarks._util import REPO, Observer, machine, med, need_root, pct, spread

sys.path.insert(0, str(REPO))

from argus.probes import libcuda
from argus.probes.base import MappedLibrary, resolve
from argus.sim.build import build
from argus.sim.launcher import SimConfig, SimJob

NOGPU = ["--no-gpu-metrics", "--no-cudart"]
CONDITIONS: Dict[str, Optional[List[str]]] = {
    "off": None,
    "cuda": ["--no-nccl", "--no-python", "--no-host", *NOGPU],
    "nccl": ["--no-cuda", "--no-python", "--no-host", *NOGPU],
    "python": ["--no-cuda", "--no-nccl", "--no-host", *NOGPU],
    "python+host": ["--no-cuda", "--no-nccl", "--host-channel", *NOGPU],
    "all": [],  # the defaults: every channel but the opt-in host channel
    "all-launches": ["--launch-steps", "all"],  # ... with the launch probes attached at every step
    "bpftrace": None,
}
BASELINE: List[str] = []  # --baseline-tree: the checkout `all-baseline` runs argus from
# setting -> (preset, layout, workload overrides); `launch-bound`: the heavy preset's ~2,100 launches a
# step data parallel, with a launch queue of 1,024 as NVIDIA's driver has, so the hosts wait in
# launches for their GPUs and argus keeps its launch probes attached (docs/probe.md)
SETTINGS: Dict[str, Tuple[str, str, Dict[str, float]]] = {
    "default": ("default", "dp", {}),
    "heavy": ("heavy", "tp-dp", {}),
    "tp": ("tp", "tp-dp", {}),
    "launch-bound": ("heavy", "dp", {"launch_queue": 1024}),
}


def bpftrace_program() -> Tuple[str, int]:
    """The bpftrace script: one count() per uprobe/uretprobe argus's cuda channel attaches to the
    simulated libcuda, at the same places. Attach points are file offsets with --unsafe: bpftrace
    0.17 mis-attaches by symbol in a library linked at a non-zero base (the simulated libcuda is,
    like lld-linked libraries): 'cannot attach uprobe, Invalid argument'. libnccl is left out:
    its functions start with endbr64, argus attaches 4 bytes in, and bpftrace 0.17 refuses offsets
    into a symbol ('compiled without (k|u)probe offset support'; uretprobes: 'cannot be attached at
    function offset'); at the function start the kernel single-steps endbr64 (measured with
    benchmarks/csrc/hitbench.c: ~11 µs a hit instead of ~1), which would be no floor."""
    libs = build()
    parts, n = [], 0
    st = os.stat(libs.libcuda)
    lp = resolve(libcuda.CHANNEL, MappedLibrary(str(libs.libcuda), str(libs.libcuda), (st.st_dev, st.st_ino)))
    assert lp.elf is not None
    for p in lp.probes:
        off = lp.elf.symbols[p.spec.symbol].offset + p.plan.offset
        if p.spec.entry:
            parts.append(f"uprobe:{libs.libcuda}:{off:#x} {{ @e[{n}] = count(); }}")
            n += 1
        if p.spec.ret and p.spec.symbol not in libcuda.entry_only(launch_returns=False):
            parts.append(f"uretprobe:{libs.libcuda}:{off:#x} {{ @r[{n}] = count(); }}")
            n += 1
    parts.append('BEGIN { printf("bpftrace attached\\n"); }')
    return "\n".join(parts), n


def run_one(setting: str, cond: str, steps: int, bt: str, ranks: int = 8) -> Dict[str, float]:
    preset, layout, sets = SETTINGS[setting]
    cfg = SimConfig(ranks=ranks, steps=steps, preset=preset, layout=layout, overrides=dict(sets), gate=True)
    job = SimJob(cfg).start()
    obs: Optional[Observer] = None
    out: Dict[str, float] = {}
    try:
        job.wait_loaded()
        args = CONDITIONS[cond]
        if args is not None:
            argv = [sys.executable, "-m", "argus", "probe", "--json", *args]
            if cond == "all-baseline":  # the same command from another checkout (--baseline-tree)
                run = (
                    f"import runpy, sys; sys.path.insert(0, {BASELINE[0]!r}); "
                    "runpy.run_module('argus', run_name='__main__', alter_sys=True)"
                )
                argv = [sys.executable, "-c", run, "probe", "--json", *args]
            for pid in job.pids.values():
                argv += ["-p", str(pid)]
            obs = Observer(argv, ready="Tracing")
        elif cond == "bpftrace":
            with tempfile.NamedTemporaryFile("w", suffix=".bt", delete=False) as f:
                f.write(bt)
            for attempt in range(5):
                obs = Observer(["bpftrace", "--unsafe", f.name], ready="bpftrace attached", merge=True)
                try:
                    out["ready_s"] = obs.wait_ready(timeout=60)
                    break
                except RuntimeError as e:
                    # EINVAL while another process holds bcc uprobes on the same instructions:
                    # bcc 0.26's Python binding attaches with a garbage ref_ctr_offset, and the
                    # kernel refuses a second uprobe there with another one ("ref_ctr_offset
                    # mismatch" in dmesg). Wait for the other holder to go.
                    obs.stop()
                    obs = None
                    if attempt == 4:
                        os.unlink(f.name)
                        print(f"  bpftrace failed: {str(e)[-300:]}", file=sys.stderr)
                        return {"failed": 1.0}
                    time.sleep(5)
        if obs is not None and "ready_s" not in out:
            out["ready_s"] = obs.wait_ready()
            time.sleep(0.2)
            obs.mark()
        job.release()
        while any(p.poll() is None for p in job.procs.values()):
            if obs is not None:
                obs.touch()
            time.sleep(0.2)
        job.wait()
        if obs is not None:
            out["cpu"] = obs.cpu_share()
            out["rss_mb"] = obs.hwm_kb / 1024
            if cond == "bpftrace":
                obs.stop()
                os.unlink(obs.argv[-1])
            else:
                obs.wait(timeout=60)
            obs = None
        out["step"] = med(job.job_step_seconds()[3:])
        return out
    finally:
        job.stop()
        shutil.rmtree(job.run_dir, ignore_errors=True)  # read already: a run leaves nothing behind
        if obs is not None:
            obs.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, 10 steps, default setting")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--settings", default="default,heavy")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--json-out", help="also write the raw runs here")
    ap.add_argument(
        "--ranks",
        type=int,
        default=8,
        help="ranks of the job (default 8: four to a CPU here, so every CPU-second the probes cost is "
        "step time; 2: a CPU each, nearer a GPU host, where a rank's threads have cores of their own)",
    )
    ap.add_argument(
        "--baseline-tree",
        help="another checkout of this repository (e.g. `git worktree add /tmp/base HEAD~3`): adds the "
        "condition `all-baseline`, its `argus probe` with the defaults, in the same rounds",
    )
    a = ap.parse_args()
    if a.baseline_tree:
        tree = os.path.abspath(a.baseline_tree)
        if not os.path.isfile(os.path.join(tree, "argus", "__main__.py")):
            print(
                f"ERROR: --baseline-tree {tree}: no argus/__main__.py there\n"
                "HINT: a checkout of this repository"
            )
            return 2
        BASELINE.append(tree)
        CONDITIONS["all-baseline"] = []
    if not need_root("sim_overhead"):
        return 3
    rounds, steps = (1, 10) if a.quick else (a.rounds, a.steps)
    settings = ["default"] if a.quick else a.settings.split(",")
    conds = [c for c in a.conditions.split(",") if c]
    if a.baseline_tree and "all-baseline" not in conds:
        conds.append("all-baseline")
    unknown = [c for c in conds if c not in CONDITIONS]
    if unknown:
        print(f"ERROR: unknown condition(s) {', '.join(unknown)}\nHINT: of {', '.join(CONDITIONS)}")
        return 2
    if "bpftrace" in conds and shutil.which("bpftrace") is None:
        print("note: no bpftrace binary: the floor row is skipped (apt-get install bpftrace)")
        conds.remove("bpftrace")
    bt, nprobes = bpftrace_program()
    print(f"# step-time overhead, simulated job, {a.ranks} ranks on {os.cpu_count()} CPUs\n")
    print(f"{machine()}\n")
    print(
        f"{rounds} round(s) × {len(conds)} conditions, interleaved (order rotated per round), "
        f"{steps} steps per run; cell = median over rounds of each run's median step time (steps 3..); "
        f"bpftrace floor: {nprobes} probes\n"
    )
    raw: Dict[str, Dict[str, List[Dict[str, float]]]] = {}
    t0 = time.monotonic()
    for setting in settings:
        res: Dict[str, List[Dict[str, float]]] = {c: [] for c in conds}
        for r in range(rounds):
            order = conds[r % len(conds) :] + conds[: r % len(conds)]
            for c in order:
                res[c].append(run_one(setting, c, steps, bt, a.ranks))
                print(f"  {setting} round {r} {c}: {res[c][-1]}", file=sys.stderr, flush=True)
        raw[setting] = res
        base = med([x["step"] for x in res["off"]]) if "off" in res else float("nan")
        print(f"## {setting} preset ({SETTINGS[setting][1]})\n")
        print(
            "| condition | median step (s) | runs (s) | overhead vs off | observer ready (s) "
            "| observer CPU (% of a core) | observer peak RSS (MB) |"
        )
        print("|---|---:|---|---:|---:|---:|---:|")
        for c in conds:
            failed = [x for x in res[c] if "failed" in x]
            res[c] = [x for x in res[c] if "failed" not in x]
            if not res[c]:
                print(f"| {c} | not measured: the observer failed to attach (see stderr) | | | | | |")
                continue
            xs = [x["step"] for x in res[c]]
            m = med(xs)
            ready = f"{med([x['ready_s'] for x in res[c]]):.1f}" if "ready_s" in res[c][0] else "—"
            cpu = f"{100 * med([x['cpu'] for x in res[c]]):.1f}%" if "cpu" in res[c][0] else "—"
            rss = f"{med([x['rss_mb'] for x in res[c]]):.0f}" if "rss_mb" in res[c][0] else "—"
            ov = pct(m, base) if c != "off" else "—"
            note = f" ({len(failed)} run(s) failed to attach)" if failed else ""
            print(f"| {c}{note} | {m:.4f} | {spread(xs)} | {ov} | {ready} | {cpu} | {rss} |")
        print("", flush=True)
    print(f"(took {time.monotonic() - t0:.0f} s)")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
