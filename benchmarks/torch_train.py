"""One rank of a small transformer training loop on CPU, torch.distributed over gloo (torchrun-style
environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK). Used by torch_overhead.py.

    python torch_train.py OUTDIR WARMUP STEPS PROFILER

PROFILER: none | torch | torch-stacks (torch.profiler, CPU activities, in-process, every timed
step inside one profiling window; the Chrome trace is exported after the timed steps).
After WARMUP steps the rank writes OUTDIR/ready<RANK> and waits for OUTDIR/go (an observer
attaches in between), then runs STEPS timed steps and writes OUTDIR/result<RANK>.json.
A step: data (a synthetic batch), forward, loss, backward, all-reduce of the gradients (DDP),
optimizer step, and loss.item().
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


def get_batch(g: torch.Generator, batch: int, seq: int, vocab: int):
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    return x, torch.roll(x, -1, dims=1)


def main() -> int:
    out, warmup, steps, profiler = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    vocab, batch, seq = 1000, int(os.environ.get("BENCH_BATCH", "8")), int(os.environ.get("BENCH_SEQ", "64"))
    model = nn.parallel.DistributedDataParallel(Model(vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)

    def train_step() -> float:
        x, y = get_batch(g, batch, seq, vocab)
        logits = model(x)
        loss = loss_fn(logits.view(-1, vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        train_step()
    dist.barrier()
    (out / f"ready{rank}").write_text(str(os.getpid()))
    while not (out / "go").exists():
        time.sleep(0.01)
    dist.barrier()
    prof = None
    if profiler in ("torch", "torch-stacks"):
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], with_stack=profiler == "torch-stacks")
        prof.__enter__()
    times, ends = [], []
    # BENCH_STOP_FILE (torch_inout.py): every 20 steps rank 0 tells every rank whether to stop, so
    # they stop at the same step (outside the timed part)
    stop_file, flag = os.environ.get("BENCH_STOP_FILE"), torch.zeros(1)
    t_all = time.perf_counter()
    for i in range(steps):
        t0 = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t0)
        ends.append(time.monotonic())
        if stop_file and i % 20 == 19:
            flag[0] = float(rank == 0 and os.path.exists(stop_file))
            dist.broadcast(flag, 0)
            if flag[0] > 0:
                break
    t_all = time.perf_counter() - t_all
    trace_bytes = 0
    if prof is not None:
        prof.__exit__(None, None, None)
        path = out / f"trace{rank}.json"
        prof.export_chrome_trace(str(path))
        trace_bytes = path.stat().st_size
        path.unlink()
    dist.barrier()
    res = {
        "rank": rank,
        "world": world,
        "times": times,
        "ends": ends,  # CLOCK_MONOTONIC s at the end of each step
        "wall_s": t_all,
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "trace_bytes": trace_bytes,
    }
    (out / f"result{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
