"""A job started the way PyTorch's tutorials start one: `torch.multiprocessing.spawn`, one stand-in
rank (tests/standins/train.py) per child. The children's command line is
`python -c "from multiprocessing.spawn import spawn_main; ..."`, and /proc/PID/environ has no rank.

    python tests/targets/spawn_job.py --style env|args --ranks 3 --steps 200 --run-dir DIR

--style env:  each rank sets RANK/WORLD_SIZE/LOCAL_RANK and MASTER_ADDR/MASTER_PORT in os.environ
              after it started (as scripts do before `init_process_group("nccl")`);
--style args: each rank sets only MASTER_ADDR/MASTER_PORT and passes its rank and the world size
              on (`init_process_group("nccl", rank=rank, world_size=world)`): no rank variable at all.

The parent maps libnccl.so.2 but never initialises CUDA, as a parent that imported a CUDA build of
torch does. Needs STANDIN_LIBDIR (python -m tests.standins.build prints it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the children import tests.standins

MASTER_PORT = "29511"


def rank_main(rank: int, world: int, style: str, steps: int, run_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = MASTER_PORT
    argv = ["--steps", str(steps), "--run-dir", run_dir]
    if style == "env":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    else:
        argv += ["--rank", str(rank), "--world-size", str(world)]
    from tests.standins import train

    code = train.main(argv)
    if code:
        raise SystemExit(code)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--style", choices=("env", "args"), default="env")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--run-dir", required=True)
    a = p.parse_args()
    import torch.multiprocessing as mp

    ctypes.CDLL(os.path.join(os.environ["STANDIN_LIBDIR"], "libnccl.so.2"))
    mp.spawn(rank_main, args=(a.ranks, a.style, a.steps, a.run_dir), nprocs=a.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
