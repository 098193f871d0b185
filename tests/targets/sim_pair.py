"""Two-rank scenarios on the simulated libraries, printing one JSON result line per rank.

usage: sim_pair.py SCENARIO RANK STORE_DIR
  late     rank 1 enters the all-reduce 0.5 s late
  hang     rank 1 enters 3 s late (rank 0 must block meanwhile, then finish)
  dead     rank 1 exits without entering (rank 0's sync must fail, not hang)
  elapsed  a 50 ms kernel between two events (one rank)
"""

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from argus.sim.bindings import Cuda, GpuError, Nccl
from argus.sim.store import FileStore


def main() -> None:
    scenario, rank, store_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ["RANK"] = str(rank)
    cu, nc = Cuda(), Nccl()
    cu.init()
    s = cu.stream()
    k = cu.load_module({"k": 1000.0})["k"]
    e0, e1 = cu.event(), cu.event()
    out: dict = {"rank": rank}
    if scenario == "elapsed":
        cu.record(e0, s)
        cu.launch(k, 50_000, s)  # 50,000 blocks x 1 us
        cu.record(e1, s)
        cu.sync(s)
        out["elapsed_ms"] = cu.elapsed_ms(e0, e1)
        print(json.dumps(out), flush=True)
        return
    store = FileStore(store_dir)
    if rank == 0:
        store.set("uid", nc.unique_id())
    comm = nc.init_rank(2, store.get("uid"), rank)
    delay = {"late": 0.5, "hang": 3.0}.get(scenario, 0.0)
    if rank == 1:
        if scenario == "dead":
            os._exit(0)
        time.sleep(delay)
    t0 = time.monotonic()
    nc.all_reduce(1 << 20, "float32", comm, s)
    out["enqueue_s"] = time.monotonic() - t0
    cu.record(e1, s)
    if rank == 0 and scenario == "hang":
        done = threading.Event()
        threading.Thread(target=lambda: (cu.sync(s), done.set()), daemon=True).start()
        out["blocked_after_2s"] = not done.wait(2.0)
        done.wait(30)
        out["sync_total_s"] = time.monotonic() - t0
    else:
        t1 = time.monotonic()
        try:
            cu.sync(s)
            out["sync_rc"] = 0
        except GpuError as e:
            out["sync_rc"] = e.code
        out["sync_wait_s"] = time.monotonic() - t1
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
