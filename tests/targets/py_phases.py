"""A tiny Python training loop with known phase proportions, for the Python channel tests.

train_step -> forward (busy, then sleeps), backward (sleeps, then busy), optimizer_step (busy).
Sleeping releases the GIL and leaves the CPU: phase shares are right only if off-CPU time is
accounted, not just on-CPU samples. Writes its own measured wall time per phase (the truth) to
argv[1] as JSON every half second. Standard library only: runs under CPython 2.7-3.13 (the
unsupported ones only have to start). Optional argv[2]: run this many seconds (default 120);
argv[3]: run the loop this many `descend` frames down (default 0), as deep as a real training
loop's stack is when it blocks.
"""

import json
import os
import sys
import time

clock = getattr(time, "perf_counter", time.time)
TRUTH = {"forward": 0.0, "backward": 0.0, "optimizer_step": 0.0, "total": 0.0, "steps": 0}


def spin(seconds):
    end = clock() + seconds
    n = 0
    while clock() < end:
        n += 1
    return n


def forward():
    spin(0.012)
    time.sleep(0.008)


def backward():
    time.sleep(0.024)
    spin(0.004)


def optimizer_step():
    spin(0.010)


def train_step():
    t0 = clock()
    forward()
    t1 = clock()
    backward()
    t2 = clock()
    optimizer_step()
    t3 = clock()
    TRUTH["forward"] += t1 - t0
    TRUTH["backward"] += t2 - t1
    TRUTH["optimizer_step"] += t3 - t2
    TRUTH["steps"] += 1


def main():
    out = sys.argv[1]
    run_for = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    start = clock()
    last = start
    while clock() - start < run_for:
        train_step()
        now = clock()
        TRUTH["total"] = now - start
        if now - last >= 0.5:
            last = now
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(TRUTH, f)
            os.rename(tmp, out)


def descend(n):
    return descend(n - 1) if n > 0 else main()


if __name__ == "__main__":
    descend(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
