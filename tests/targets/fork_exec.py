"""A world-of-1 stand-in rank (tests/standins/train.py) that forks or execs while it is traced.

    STANDIN_LIBDIR=... RANK=0 WORLD_SIZE=1 python fork_exec.py fork|exec RUN_DIR STEPS

fork: before training, fork a child that calls the probed `cuInit(1)` every 5 ms for 120 s, as a
      forked worker calling into a library its parent mapped would (it inherits the parent's
      text, uprobe breakpoints included); the child writes `child <pid>` to RUN_DIR/child, then
      `alive <n calls>` lines to RUN_DIR/child.log every 0.5 s.
exec: train STEPS steps, then exec a new image of the same rank (same pid, new address space),
      which trains STEPS more and writes RUN_DIR/exec'd first.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.standins import train


def child_loop(run_dir: Path) -> None:
    cuda, _nccl = train.load_libraries(os.environ["STANDIN_LIBDIR"])
    (run_dir / "child").write_text(f"child {os.getpid()}\n")
    n, last = 0, time.monotonic()
    with open(run_dir / "child.log", "a", buffering=1) as log:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            cuda.cuInit(1)  # CUDA_ERROR_INVALID_VALUE: were it counted as the rank's, it would show
            n += 1
            time.sleep(0.005)
            if time.monotonic() - last > 0.5:
                last = time.monotonic()
                log.write(f"alive {n}\n")
    os._exit(0)


def main() -> int:
    mode, run_dir, steps = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    argv = ["--steps", steps, "--run-dir", str(run_dir)]
    if mode == "fork":
        train.load_libraries(os.environ["STANDIN_LIBDIR"])
        if os.fork() == 0:
            child_loop(run_dir)
        return train.main(argv)
    if mode == "exec":
        code = train.main(argv)
        if code:
            return code
        os.execv(sys.executable, [sys.executable, __file__, "exec2", str(run_dir), steps])
    if mode == "exec2":
        (run_dir / "exec'd").write_text(f"{os.getpid()}\n")
        return train.main(argv)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
