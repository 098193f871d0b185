# ruff: noqa: E501
"""GPU part of benchmarks/gpu_check.sh: a one-GPU PyTorch training loop with an NCCL communicator of
one rank, probed by `argus probe`; reports which real libcuda/libnccl symbols were attached, what was
captured and the overhead (baseline and probed runs, interleaved).

    sudo python -m benchmarks.gpu_torch OUTDIR [--python PY] [--steps 200] [--rounds 2]

PY must have a CUDA build of torch; the agent runs under the interpreter running this module (the
repo's .venv, which can import bcc). Exit 0 with a SKIP line when torch or the GPU is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from benchmarks._util import REPO, Observer, med

TRAIN = r"""
import os, sys, time, json
import torch, torch.distributed as dist, torch.nn as nn
out, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("nccl")
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
model = nn.parallel.DistributedDataParallel(nn.TransformerEncoder(layer, 4).to(dev), device_ids=[0])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(16, 256, 512, device=dev)
def step():
    loss = model(x).float().pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()
for _ in range(10):
    step()
open(os.path.join(out, "ready"), "w").write(str(os.getpid()))
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.01)
times = []
for _ in range(steps):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
json.dump({"times": times, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)},
          open(os.path.join(out, "result.json"), "w"))
dist.destroy_process_group()
"""


def run(py: str, out: Path, steps: int, probe: bool, tag: str) -> Dict:
    d = out / tag
    d.mkdir(parents=True, exist_ok=True)
    script = d / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + hash(tag) % 500), RANK="0")
    env.update(WORLD_SIZE="1", LOCAL_RANK="0", TORCHELASTIC_RUN_ID=f"gpucheck-{tag}")
    with open(d / "train.log", "w") as log:
        p = subprocess.Popen(
            [py, str(script), str(d), str(steps)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    res: Dict = {}
    obs = None
    try:
        deadline = time.monotonic() + 180
        while not (d / "ready").exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"training loop failed: {(d / 'train.log').read_text()[-1500:]}")
            time.sleep(0.1)
        if probe:
            sys.path.insert(0, str(REPO))
            from argus.agent.attach import inspect
            from argus.probes.base import confirm_stubs

            plan = inspect(p.pid)
            live = {ch: confirm_stubs(p.pid, lp) for ch, lp in plan.items()}  # slots as the job has them
            res["attached"] = {
                ch: {
                    "library": lp.library.path,
                    "symbols": [
                        f"{x.spec.symbol}"
                        f"{f' -> {x.target:#x} behind its stub' if x.stub is not None else ''}"
                        f"{'' if x.plan.fast else ' (single-stepped: ' + x.plan.insn + ')'}"
                        for x in lp.probes
                    ],
                    "slots": live[ch],
                    "missing_optional": lp.missing_optional,
                }
                for ch, lp in plan.items()
            }
            argv = [sys.executable, "-m", "argus", "probe", "-p", str(p.pid), "--json"]
            obs = Observer(argv, d / "probe.jsonl", ready="Tracing")
            res["ready_s"] = obs.wait_ready()
            obs.mark()
        (d / "go").write_text("go")
        while p.poll() is None:
            if obs:
                obs.touch()
            time.sleep(0.2)
        if obs:
            res["agent_cpu"] = obs.cpu_share()
            obs.wait(timeout=120)
            res["agent_rss_mb"] = obs.hwm_kb / 1024
            res["probe_stderr"] = "".join(obs.err)
            obs = None
        r = json.loads((d / "result.json").read_text())
        res.update(r)
        res["step"] = med(r["times"][5:])
        return res
    finally:
        if p.poll() is None:
            p.kill()
        if obs is not None:
            obs.stop()


def captured(path: Path) -> List[str]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steps = [x for x in lines if x.get("step") is not None]
    # launch counts come from the steps the launch windows covered (--launch-steps, default 3/30)
    sampled = [x for x in steps if x.get("cuda", {}).get("launches", {}).get("sampled", True)]
    out = [f"{len(lines)} JSON records, {len(steps)} with a step number, {len(sampled)} with launches"]
    if not lines:
        return out
    pick = sampled or steps or lines
    d = pick[len(pick) // 2]
    cu, nc = d.get("cuda", {}), d.get("nccl", {})
    launches = cu.get("launches", {})
    top = sorted(launches.get("by_kernel", {}).items(), key=lambda kv: -kv[1])[:5]
    out.append(
        f"step {d.get('step')}: {d.get('duration_ns', 0) / 1e6:.1f} ms, launches {launches.get('total')}"
    )
    out.append(f"  top kernels: {top}")
    out.append(
        f"  sync: {cu.get('sync', {}).get('count')} waits, {cu.get('sync', {}).get('wait_ns', 0) / 1e6:.1f} ms"
    )
    out.append(f"  nccl ops: {json.dumps(nc.get('ops', {}))[:400]}")
    out.append(f"  nccl comms: {json.dumps(nc.get('comms', {}))[:300]}")
    out.append(f"  errors: cuda {cu.get('errors')} nccl {nc.get('errors')}")
    out.append(f"  python phases: {json.dumps(d.get('python', {}).get('phases', {}))[:300]}")
    out.append(f"  gpu: {json.dumps(d.get('gpu', {}))[:300]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    chk = subprocess.run(
        [
            a.python,
            "-c",
            "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__)",
        ],
        capture_output=True,
        text=True,
    )
    if chk.returncode != 0:
        print(
            f"SKIP: GPU training loop: {a.python} has no CUDA torch ({chk.stderr.strip().splitlines()[-1:]})"
        )
        return 0
    runs: Dict[str, List[Dict]] = {"off": [], "argus": []}
    for r in range(a.rounds):
        for cond in ("off", "argus") if r % 2 == 0 else ("argus", "off"):
            res = run(a.python, out, a.steps, cond == "argus", f"{cond}{r}")
            runs[cond].append(res)
            print(f"  round {r} {cond}: step {res['step'] * 1e3:.2f} ms", flush=True)
    first = runs["argus"][0]
    print(f"\nGPU {first['gpu']}, torch {first['torch']}, NCCL {first['nccl']}")
    print("\n# attached uprobes (real libraries)\n")
    for ch, info in first["attached"].items():
        print(f"- {ch}: {info['library']}: {len(info['symbols'])} symbols: {', '.join(info['symbols'])}")
        if info["missing_optional"]:
            print(f"  missing (optional): {', '.join(info['missing_optional'])}")
    print("\nprobe stderr:\n" + first["probe_stderr"])
    print("# captured (middle step of the first probed run)\n")
    print("\n".join(captured(out / "argus0" / "probe.jsonl")))
    off, on = med([x["step"] for x in runs["off"]]), med([x["step"] for x in runs["argus"]])
    print("\n# overhead (one GPU, NCCL world size 1)\n")
    print("| condition | median step (ms) | runs (ms) | overhead | agent CPU | agent RSS (MB) | ready (s) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    ms = {c: ", ".join(f"{x['step'] * 1e3:.2f}" for x in rs) for c, rs in runs.items()}
    print(f"| off | {off * 1e3:.2f} | {ms['off']} | — | — | — | — |")
    print(
        f"| argus probe | {on * 1e3:.2f} | {ms['argus']} "
        f"| {100 * (on - off) / off:+.2f}% | {100 * med([x['agent_cpu'] for x in runs['argus']]):.1f}% "
        f"| {med([x['agent_rss_mb'] for x in runs['argus']]):.0f} | {med([x['ready_s'] for x in runs['argus']]):.1f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
