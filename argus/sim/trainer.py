"""One rank of the simulated training job (run by `argus sim run`, one process per rank).

Shaped like a PyTorch/Megatron loop driving libcuda and libnccl: a data loader, a model whose
layers launch forward and backward kernels, DDP-style bucketed gradient all-reduce on a
communication stream overlapping backward, an optimizer step, one host sync per step
(`loss.item()`), and (option `timers`, on by default) Megatron-style CUDA-event timers read with
cuEventElapsedTime. Always, as stock PyTorch does: ProcessGroupNCCL's events around every DP
collective with its watchdog thread polling them (TORCH_NCCL_ENABLE_TIMING=1 in the environment
adds its start events and elapsed-time reads), and the caching allocator's record_stream events.
Layouts: dp, tp-dp (tensor-parallel all-reduces inside layers, or all-gather/reduce-scatter pairs
with `seq_parallel`), pp-dp (GPipe microbatches with send/recv between stages); dp and tp-dp run
`grad_accum` micro-batches per step (1 unless a preset says otherwise). Rank identity comes from
the environment, as torchrun sets it.

Each step appends one JSON line of ground truth (what this rank issued and measured) to
rank<R>.jsonl in the run directory. Standard library only: any CPython 3.9+ runs it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
from collections import Counter, deque
from typing import Callable, Deque, Dict, List, Optional

from argus.sim.bindings import CU_EVENT_DISABLE_TIMING, Cuda, GpuError, Nccl
from argus.sim.faults import Fault, from_dicts
from argus.sim.store import FileStore
from argus.sim.workload import Workload, bwd_layer, is_mlp

HASH_SEED = 0x6A09E667F3BCC909
M64 = 0xFFFFFFFFFFFFFFFF


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def comm_hash(data: bytes) -> int:
    """The simulated NCCL's commHash of these bytes (csrc/nccl.c hash_words): ground truth only."""
    h = HASH_SEED
    for i in range(0, len(data) - 7, 8):
        h = _mix64(h ^ int.from_bytes(data[i : i + 8], "little"))
    return h


class StepLog:
    """What this rank issued during one step: the ground truth the probes are checked against."""

    def __init__(self) -> None:
        self.launches: Counter = Counter()
        self.colls: Dict[str, List[int]] = {}
        self.errors: Counter = Counter()
        self.memcpy: Counter = Counter()
        self.alloc_bytes = 0
        self.free_bytes = 0

    def coll(self, op: str, nbytes: int) -> None:
        c = self.colls.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += nbytes


class DataLoader:
    """Host-side batch production (sleeps like I/O) and an async host-to-device copy."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def __next__(self) -> int:
        t = self.t
        time.sleep(t.w.data_ms / 1e3)
        stall = t.fault_at("dataloader_stall", t.step)
        if stall is not None:
            time.sleep(stall.seconds)
        t.cu.h2d_async(t.batch_ptr, t.w.batch_bytes, t.compute)
        t.log.memcpy["HtoD"] += t.w.batch_bytes
        return t.batch_ptr


class KernelCompiler:
    """A JIT compiler for new shapes (the host stall fault): CPU-bound, launches nothing."""

    def compile(self, seconds: float) -> int:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += self.codegen(2000)
        return n

    def codegen(self, n: int) -> int:
        return sum(i * i for i in range(n)) & 1


# Sequence parallelism (Megatron-LM, --sequence-parallel; core/tensor_parallel/layers.py and
# mappings.py): activations between the tensor-parallel blocks are split along the sequence, so the
# all-reduce after each row-parallel GEMM becomes a reduce-scatter, and each column-parallel GEMM
# first all-gathers its input. Backward mirrors it: the gradient of a reduce-scatter is an
# all-gather (before the row-parallel dgrad), the column-parallel GEMM all-gathers its saved input
# again for its wgrad and reduce-scatters its dgrad. 4 collectives forward, 6 backward per layer.
SP_FWD_GATHER = ("gemm_qkv_fwd", "gemm_mlp_up_fwd")
SP_BWD_GATHER = ("gemm_mlp_down_dgrad", "gemm_mlp_up_dgrad", "gemm_attn_proj_dgrad", "gemm_qkv_dgrad")


class TransformerLayer:
    def __init__(self, trainer: Trainer, index: int) -> None:
        self.t = trainer
        self.index = index

    def forward(self, mb_scale: float) -> None:
        t = self.t
        t.allocator.malloc()
        sp = t.tp_comm is not None and t.w.seq_parallel
        for name, us in t.w.fwd_layer():
            if sp and name in SP_FWD_GATHER:
                t.tp_all_gather()
            t.launch(name, us * mb_scale)
            if t.tp_comm and name in ("gemm_attn_proj_fwd", "gemm_mlp_down_fwd"):
                if sp:
                    t.tp_reduce_scatter()
                else:
                    t.all_reduce(t.tp_comm, t.w.act_bytes // 2, t.compute)
        t.allocator.free(t.compute)  # a block of the layer's, used on the compute stream

    def backward(self, mb_scale: float) -> None:
        t = self.t
        t.allocator.malloc()
        sp = t.tp_comm is not None and t.w.seq_parallel
        for name, us in bwd_layer(t.w.fwd_layer()):
            if sp and name in SP_BWD_GATHER:
                t.tp_all_gather()
            t.launch(name, us * mb_scale * t.bwd_factor)
            if t.tp_comm and name in ("gemm_mlp_up_dgrad", "gemm_qkv_dgrad"):
                if sp:
                    t.tp_reduce_scatter()
                else:
                    t.all_reduce(t.tp_comm, t.w.act_bytes // 2, t.compute)
        t.allocator.free(t.compute)


class Model:
    def __init__(self, trainer: Trainer, layers: int) -> None:
        self.t = trainer
        self.layers = [TransformerLayer(trainer, i) for i in range(layers)]

    def forward(self, mb_scale: float = 1.0) -> None:
        for layer in self.layers:
            layer.forward(mb_scale)
        self.t.launch("cross_entropy_fwd", 50 * self.t.w.scale * mb_scale)

    def backward(self, mb_scale: float = 1.0, grad_sync: bool = True) -> None:
        """Backward in reverse layer order; DDP buckets all-reduce on the comm stream as they fill."""
        t = self.t
        t.launch("cross_entropy_bwd", 50 * t.w.scale * mb_scale)
        for i, layer in enumerate(reversed(self.layers)):
            layer.backward(mb_scale)
            if grad_sync and (i + 1) % t.w.bucket_layers == 0:
                t.reduce_bucket(i // t.w.bucket_layers)


class Optimizer:
    def __init__(self, trainer: Trainer, layers: int) -> None:
        self.t = trainer
        self.groups = max(1, layers // trainer.w.opt_kernels_per_layers)

    def step(self) -> None:
        t = self.t
        t.launch("grad_norm_reduce", 100 * t.w.scale)
        for _ in range(self.groups):
            t.launch("multi_tensor_adam", t.w.opt_us * t.w.scale)


def env_flag(name: str) -> bool:
    """A boolean environment variable as PyTorch reads its TORCH_* switches (c10 getCvarBool)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on")


def name_thread(name: str) -> None:
    """The OS name of the calling thread (PR_SET_NAME), as c10::setThreadName gives PyTorch's."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Work:
    """A collective's WorkNCCL: its events, held by the watchdog until it retires and by the caller
    until it has waited on it; the events go back to the cache when both let go."""

    __slots__ = ("end", "refs", "seq", "start")

    def __init__(self, seq: int, start: int, end: int) -> None:
        self.seq, self.start, self.end, self.refs = seq, start, end, 2


class ProcessGroupNCCL:
    """What torch.distributed's ProcessGroupNCCL does around each collective, on the main thread:
    cuEventRecord(pre, compute) and cuStreamWaitEvent(nccl stream, pre) (syncStream), with
    TORCH_NCCL_ENABLE_TIMING=1 cuEventRecord(start, nccl stream), the NCCL call, cuEventRecord(end,
    nccl stream); the work joins the watchdog's list. Start/end events come from a cache and are
    reused once retired (PyTorch's CUDA event cache). The watchdog thread wakes every 100 ms and
    queries each pending work's events (cuEventQuery(start) too with timing); once `end` is done
    it reads cuEventElapsedTime(start, end) with timing and retires the work."""

    POLL_S = 0.1  # ProcessGroupNCCL's kWatchdogThreadSleepMillis

    def __init__(self, cu: Cuda, compute: int, stream: int) -> None:
        self.cu, self.compute, self.stream = cu, compute, stream
        self.timing = env_flag("TORCH_NCCL_ENABLE_TIMING")  # read from the environment, as PyTorch
        self.flags = 0 if self.timing else CU_EVENT_DISABLE_TIMING
        self.lock = threading.Lock()  # pending, cache, elapsed: main thread and watchdog
        self.pending: List[Work] = []
        self.cache: List[int] = []
        self.elapsed: Dict[int, float] = {}  # seq -> ms read by the watchdog, taken by the trainer
        self.errors = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watchdog, name="pt_nccl_watchdg", daemon=True)
        self.thread.start()

    def _event(self) -> int:
        with self.lock:
            if self.cache:
                return self.cache.pop()
        return self.cu.event(self.flags)

    def sync_streams(self, pre: int) -> None:
        """The NCCL stream waits for what the compute stream has issued so far."""
        self.cu.record(pre, self.compute)
        self.cu.wait_event(self.stream, pre)

    def run(self, seq: int, issue: Callable[[], None]) -> Work:
        """Issue one collective on the NCCL stream between the work's events."""
        start = self._event() if self.timing else 0
        end = self._event()
        if start:
            self.cu.record(start, self.stream)
        issue()
        self.cu.record(end, self.stream)
        work = Work(seq, start, end)
        with self.lock:
            self.pending.append(work)
        return work

    def wait(self, work: Work) -> None:
        """work.wait(): the compute stream waits for the collective; the caller lets go of it."""
        self.cu.wait_event(self.compute, work.end)
        with self.lock:
            self._unref(work)

    def _unref(self, work: Work) -> None:  # with self.lock held
        work.refs -= 1
        if work.refs == 0:
            self.cache.append(work.end)
            if work.start:
                self.cache.append(work.start)

    def poll(self) -> None:
        """One watchdog pass: query every pending work, retire the finished ones."""
        with self.lock:
            works = list(self.pending)
        cu = self.cu
        for w in works:
            if w.start:
                cu.query(w.start)  # isStarted()
            if cu.query(w.end) != 0:  # isCompleted()
                continue
            ms = cu.elapsed_ms(w.start, w.end) if w.start else None
            with self.lock:
                self.pending.remove(w)
                if ms is not None:
                    self.elapsed[w.seq] = ms
                self._unref(w)

    def take_elapsed(self) -> Dict[int, float]:
        with self.lock:
            out, self.elapsed = self.elapsed, {}
        return out

    def _watchdog(self) -> None:
        name_thread("pt_nccl_watchdg")
        while not self._stop.wait(self.POLL_S):
            try:
                self.poll()
            except GpuError as e:  # a failed stream: say it once per pass, keep watching
                self.errors += 1
                print(f"watchdog: {e}", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)


class CachingAllocator:
    """The CUDA caching allocator's record_stream events, and only those (no memory is allocated):
    freeing a block used on a stream records an event from the allocator's pool on that stream
    (insert_events); each malloc first processes the outstanding events in FIFO order, stopping at
    the first one not done (process_events), done ones going back to the pool. When too many are
    outstanding the oldest is waited for (cuEventSynchronize), as the allocator would block."""

    # Above what any preset keeps outstanding (tp: 640 frees a step, all done at the step's sync),
    # so the presets never block here: a blocking sync per layer would be a step boundary to a
    # tracer, which no PyTorch job has.
    MAX_OUTSTANDING = 1024

    def __init__(self, cu: Cuda) -> None:
        self.cu = cu
        self.pool: List[int] = []
        self.outstanding: Deque[int] = deque()

    def malloc(self) -> None:
        cu, out = self.cu, self.outstanding
        while out:
            if cu.query(out[0]) != 0:
                break
            self.pool.append(out.popleft())

    def free(self, stream: int) -> None:
        cu = self.cu
        if len(self.outstanding) >= self.MAX_OUTSTANDING:
            oldest = self.outstanding.popleft()
            cu.event_sync(oldest)
            self.pool.append(oldest)
        ev = self.pool.pop() if self.pool else cu.event(CU_EVENT_DISABLE_TIMING)
        cu.record(ev, stream)
        self.outstanding.append(ev)


class Trainer:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.w = Workload(**cfg["workload"])
        self.layout: str = cfg["layout"]
        self.steps: int = cfg["steps"]
        self.faults: List[Fault] = [f for f in from_dicts(cfg.get("faults", [])) if f.applies(self.rank)]
        self.all_faults: List[Fault] = from_dicts(cfg.get("faults", []))
        self.run_dir: str = cfg["run_dir"]
        self.out = open(os.path.join(self.run_dir, f"rank{self.rank}.jsonl"), "a", buffering=1)
        self.cu = Cuda()
        self.nccl = Nccl()
        self.store = FileStore(cfg.get("store") or os.path.join(self.run_dir, "store"))
        self.compute_factor = 1.0
        self.mlp_factor = 1.0
        self.bwd_factor = 1.0
        self.step = -1
        self.log = StepLog()
        self.tp_comm: Optional[int] = None
        self.pp_comm: Optional[int] = None
        self.dp_seq = 0  # collectives issued on the DP communicator (its collOpCount)
        self.step_dp_seqs: List[int] = []  # those of the current step
        self.comm_info: Dict[str, dict] = {}
        self.timers: bool = bool(cfg.get("timers", True))  # Megatron-style CUDA-event timers
        self.ev: Dict[str, int] = {}
        self.epoch = 0  # the process's sync epoch after the previous step's sync (errors per step)

    # ---- helpers ---------------------------------------------------------------------------------

    def fault_at(self, kind: str, step: int) -> Optional[Fault]:
        for f in self.faults:
            if f.kind == kind and f.step <= step < f.step + max(1, f.steps):
                return f
        return None

    def launch(self, name: str, us: float) -> None:
        factor = self.compute_factor * (self.mlp_factor if is_mlp(name) else 1.0)
        self.cu.launch(self.kernels[name], int(us * factor), self.compute)
        self.log.launches[name] += 1

    def all_reduce(self, comm: int, nbytes: int, stream: int) -> None:
        self.nccl.all_reduce(nbytes // 2, "bfloat16", comm, stream)
        self.log.coll("AllReduce", nbytes)

    def tp_all_gather(self) -> None:
        """Sequence parallel: gather the sequence shards of an activation (act_bytes / 2 in all)."""
        assert self.tp_comm is not None
        shard = self.w.act_bytes // 2 // self.w.tp
        self.nccl.all_gather(shard // 2, "bfloat16", self.tp_comm, self.compute)
        self.log.coll("AllGather", shard)

    def tp_reduce_scatter(self) -> None:
        assert self.tp_comm is not None
        shard = self.w.act_bytes // 2 // self.w.tp
        self.nccl.reduce_scatter(shard // 2, "bfloat16", self.tp_comm, self.compute)
        self.log.coll("ReduceScatter", shard)

    def reduce_bucket(self, k: int) -> None:
        """DDP: the comm stream waits for the bucket's gradients, then all-reduces them
        (ProcessGroupNCCL.allreduce: see ProcessGroupNCCL for the calls)."""
        self.pg.sync_streams(self.bucket_events[k % len(self.bucket_events)])
        if k == 0:
            self.mark("comm_start", self.comm)
        self.maybe_hang()
        nbytes = self.w.grad_bytes_per_layer * self.w.bucket_layers // (self.w.tp if self.tp_comm else 1)
        self.works.append(self.pg.run(self.dp_seq, lambda: self.all_reduce(self.dp_comm, nbytes, self.comm)))
        self.step_dp_seqs.append(self.dp_seq)
        self.dp_seq += 1

    def mark(self, name: str, stream: int) -> None:
        """A Megatron-style timer event (option `timers`)."""
        if self.timers:
            self.cu.record(self.ev[name], stream)

    def maybe_hang(self) -> None:
        for f in self.faults:
            if f.kind != "hang":
                continue
            seq = f.collective if f.collective >= 0 else 1 + f.step * self.buckets_per_step
            if self.dp_seq == seq:
                self.emit({"hang": {"step": self.step, "dp_seq": seq, "t_ns": self.cu.now()}})
                print(
                    f"rank {self.rank}: injected hang before DP collective {seq} (step {self.step})",
                    file=sys.stderr,
                    flush=True,
                )
                while True:
                    time.sleep(3600)

    def emit(self, obj: dict) -> None:
        self.out.write(json.dumps(obj, separators=(",", ":")) + "\n")

    # ---- setup -----------------------------------------------------------------------------------

    def comm_from_store(self, name: str, nranks: int, rank: int, config: bool = False) -> int:
        if rank == 0:
            uid = self.nccl.unique_id()
            self.store.set(name, uid)
        else:
            uid = self.store.get(name)
        comm = self.nccl.init_rank(nranks, uid, rank, config=config)
        self.comm_info[name] = {
            "hash": comm_hash(uid),
            "nranks": nranks,
            "rank": rank,
            "handle": comm,
        }
        return comm

    def split(self, name: str, color: int) -> int:
        seq = self.world_splits
        self.world_splits += 1
        comm = self.nccl.split(self.world_comm, color, self.rank)
        parent = self.comm_info["world"]["hash"]
        words = (
            parent.to_bytes(8, "little")
            + seq.to_bytes(8, "little")
            + color.to_bytes(8, "little", signed=True)
        )
        self.comm_info[name] = {
            "hash": comm_hash(words),
            "nranks": self.nccl.count(comm),
            "rank": self.nccl.user_rank(comm),
            "handle": comm,
        }
        return comm

    def setup(self) -> None:
        cu, w = self.cu, self.w
        cu.init(self.local_rank % 8)
        self.kernels = cu.load_module(w.kernel_table())
        # Frameworks probe optional kernels; a failing lookup is a real non-zero CUresult.
        self.setup_errors = {"cuModuleGetFunction:500": 1 if cu.get_function_rc("flash_attn_v3_fwd") else 0}
        self.compute = cu.stream()
        self.comm = cu.stream()
        if self.timers:
            self.ev = {
                k: cu.event()
                for k in (
                    "fwd_start",
                    "fwd_end",
                    "bwd_start",
                    "bwd_end",
                    "opt_start",
                    "opt_end",
                    "comm_start",
                    "comm_end",
                )
            }
        self.allocator = CachingAllocator(cu)
        self.works: List[Work] = []  # this step's DP works, waited on at finish_grad_sync
        self.batch_ptr = cu.alloc(w.batch_bytes)
        self.loss_ptr = cu.alloc(4096)
        self.params_ptr = cu.alloc(w.grad_bytes_per_layer * w.layers)

        self.world_splits = 0
        self.world_comm = self.comm_from_store(
            "world", self.world, self.rank, config=self.cfg.get("init_config", False)
        )
        tp, pp = w.tp, w.pp
        if self.layout == "tp-dp":
            self.tp_comm = self.split("tp", self.rank // tp)
            self.dp_comm = self.split("dp", self.rank % tp)
            layers = w.layers
        elif self.layout == "pp-dp":
            self.pp_comm = self.split("pp", self.rank // pp)
            self.dp_comm = self.split("dp", self.rank % pp)
            self.stage = self.rank % pp
            layers = w.layers // pp
        else:
            self.dp_comm = self.split("dp", 0)
            layers = w.layers
        self.model = Model(self, layers)
        self.optimizer = Optimizer(self, layers)
        self.loader = DataLoader(self)
        self.buckets_per_step = max(1, layers // w.bucket_layers)
        self.bucket_events = [cu.event() for _ in range(self.buckets_per_step)]
        self.pg = ProcessGroupNCCL(cu, self.compute, self.comm)  # starts its watchdog thread
        self.dp_spans_hosts = self.nccl.spans_hosts(self.dp_comm)
        # DDP broadcasts parameters from rank 0 at construction (_sync_module_states), and waits.
        count = w.grad_bytes_per_layer * layers // 2
        self.pg.sync_streams(cu.event(CU_EVENT_DISABLE_TIMING))
        work = self.pg.run(0, lambda: self.nccl.broadcast(count, "bfloat16", 0, self.dp_comm, self.comm))
        self.pg.wait(work)
        self.dp_seq = 1
        cu.sync(self.comm)
        self.epoch = cu.sync_epoch()
        self.gc_heap: list = []
        if any(f.kind == "gc_pause" for f in self.faults):
            self.gc_heap = [[i] for i in range(1_500_000)]  # live tracked objects make full GCs slow
        self.emit(
            {
                "meta": {
                    "rank": self.rank,
                    "world": self.world,
                    "pid": os.getpid(),
                    "layout": self.layout,
                    "python": sys.version.split()[0],
                    "nccl_version": self.nccl.version(),
                    "comms": {k: {kk: vv for kk, vv in v.items()} for k, v in self.comm_info.items()},
                    "buckets_per_step": self.buckets_per_step,
                    "setup_errors": self.setup_errors,
                    "faults": [f.to_dict() for f in self.faults],
                    "timers": self.timers,
                    "nccl_timing": self.pg.timing,
                    "dp_spans_hosts": self.dp_spans_hosts,
                    "host": os.environ.get("ARGUS_HOST", ""),
                    # step times (start_ns ...) are CLOCK_MONOTONIC, dp_* times CLOCK_REALTIME
                    "realtime_minus_monotonic_ns": time.time_ns() - cu.now(),
                    "t_ns": cu.now(),
                }
            }
        )

    # ---- the loop --------------------------------------------------------------------------------

    def apply_faults(self, step: int) -> List[str]:
        active = []
        self.compute_factor = self.mlp_factor = self.bwd_factor = 1.0
        for f in self.faults:
            if step < f.from_step:
                continue
            if f.kind == "straggler":
                self.compute_factor = f.factor
            elif f.kind == "masked_straggler":
                self.mlp_factor = f.factor
            elif f.kind == "bubble":
                self.bwd_factor = f.factor
            else:
                continue
            active.append(f.kind)
        for f in self.all_faults:  # every rank applies a slow link so the model agrees everywhere
            if f.kind == "slow_link" and step >= f.from_step:
                self.nccl.set_link(f.ranks[0], f.ranks[1], f.factor)
                if f.applies(self.rank):
                    active.append("slow_link")
        return active

    def train_step(self, step: int) -> dict:
        cu, mark = self.cu, self.mark
        self.log = StepLog()
        self.step_dp_seqs = []
        active = self.apply_faults(step)
        t0 = cu.now()
        clock = time.perf_counter_ns
        host: Dict[str, int] = {}  # host wall time per phase (truth for the Python channel)
        h = clock()
        next(self.loader)
        host["data"] = clock() - h
        stall = self.fault_at("host_stall", step)
        if stall is not None:
            h = clock()
            KernelCompiler().compile(stall.seconds)
            host["compile"] = clock() - h
        pause = self.fault_at("gc_pause", step)
        gc_s = 0.0
        if pause is not None:
            g0 = time.monotonic()
            while time.monotonic() - g0 < pause.seconds:
                gc.collect()
            gc_s = time.monotonic() - g0
        act = cu.alloc(self.w.act_bytes * 4)
        self.log.alloc_bytes += self.w.act_bytes * 4
        if self.layout == "pp-dp":
            self.pipeline_step()
        else:
            # grad_accum micro-batches: all forwards, then all backwards (as pipeline_step; the
            # order does not change what is issued), gradients synced in the last backward
            mbs = self.w.grad_accum
            mark("fwd_start", self.compute)
            h = clock()
            for _ in range(mbs):
                self.model.forward(1.0 / mbs)
            host["forward"] = clock() - h
            mark("fwd_end", self.compute)
            mark("bwd_start", self.compute)
            h = clock()
            for m in range(mbs):
                self.model.backward(1.0 / mbs, grad_sync=(m == mbs - 1))
            self.finish_grad_sync()
            host["backward"] = clock() - h
        mark("opt_start", self.compute)
        h = clock()
        self.optimizer.step()
        host["optimizer"] = clock() - h
        mark("opt_end", self.compute)
        cu.d2h_async(self.loss_ptr, 4, self.compute)  # loss.item()
        self.log.memcpy["DtoH"] += 4
        cu.sync(self.compute)
        # the sync as the library saw it: around the Python call it would also hold the wait for
        # the GIL, when the watchdog thread has it as the sync returns
        s0, s1 = cu.last_sync()
        epoch = cu.sync_epoch()
        # every thread's cuEventQuery CUDA_ERROR_NOT_READY (this thread's, the watchdog's) since the
        # previous step's sync returned: what a tracer counts for the step, sync to sync
        not_ready = cu.not_ready_count(self.epoch, epoch)
        self.epoch = epoch
        if not_ready:
            self.log.errors["cuEventQuery:600"] += not_ready
        timers: Dict[str, float] = {}
        if self.timers:
            ev = self.ev
            timers = {
                "forward": cu.elapsed_ms(ev["fwd_start"], ev["fwd_end"]),
                "backward": cu.elapsed_ms(ev["bwd_start"], ev["bwd_end"]),
                "optimizer": cu.elapsed_ms(ev["opt_start"], ev["opt_end"]),
                "grad_sync": cu.elapsed_ms(ev["comm_start"], ev["comm_end"]),
            }
        dp = self.dp_truth(self.step_dp_seqs)
        cu.free(act)
        self.log.free_bytes += self.w.act_bytes * 4
        t1 = cu.now()
        rec = {
            "step": step,
            "start_ns": t0,
            "end_ns": t1,
            "sync_enter_ns": s0,
            "sync_exit_ns": s1,
            "sync_wait_ns": s1 - s0,
            "launches": dict(self.log.launches),
            "colls": self.log.colls,
            "timers_ms": timers,
            "errors": dict(self.log.errors),
            "memcpy": dict(self.log.memcpy),
            "alloc_bytes": self.log.alloc_bytes,
            "free_bytes": self.log.free_bytes,
            "faults": active,
            "host_phase_ns": host,
            **dp,
        }
        if self.pg.timing:
            rec["pg_elapsed_ms"] = {str(k): v for k, v in sorted(self.pg.take_elapsed().items())}
        if gc_s:
            rec["gc_s"] = gc_s
        if stall is not None:
            rec["host_stall_s"] = stall.seconds
        return rec

    def finish_grad_sync(self) -> None:
        """Megatron's finish_grad_sync (timers: the compute stream waits for the grad-sync timer's
        end event), then DDP's: work.wait() on every bucket's all-reduce."""
        cu = self.cu
        if self.timers:
            ev = self.ev
            cu.record(ev["comm_end"], self.comm)
            # A poll right after enqueue: usually CUDA_ERROR_NOT_READY (counted by the library)
            cu.query(ev["comm_end"])
            cu.record(ev["bwd_end"], self.compute)
            cu.wait_event(self.compute, ev["comm_end"])
        for work in self.works:
            self.pg.wait(work)
        self.works = []

    def dp_truth(self, seqs: List[int]) -> dict:
        """When this rank's NCCL stream reached each DP collective of the step (and, when the DP
        communicator spans hosts, when its network proxy first sent for it): CLOCK_REALTIME ns
        from the library. Read after the step's sync, so the stream has reached them all; the
        proxy's first send may trail its thread's wake-up by a little: waited for, briefly."""
        arrive: List[Optional[int]] = []
        first: List[Optional[int]] = []
        deadline = time.monotonic() + 0.05
        for seq in seqs:
            got = self.nccl.coll_times(self.dp_comm, seq)
            while self.dp_spans_hosts and (got is None or not got[1]) and time.monotonic() < deadline:
                time.sleep(0.0005)
                got = self.nccl.coll_times(self.dp_comm, seq)
            arrive.append(got[0] if got else None)
            first.append(got[1] or None if got else None)
        out: dict = {"dp_seqs": seqs, "dp_gpu_arrive_ns": arrive}
        if self.dp_spans_hosts:
            out["dp_first_send_ns"] = first
        return out

    def pipeline_step(self) -> None:
        """GPipe: all forward microbatches, then all backward; p2p on the compute stream."""
        mark, n = self.mark, self.nccl
        mbs, last = self.w.microbatches, self.w.pp - 1
        scale = 1.0 / mbs
        count = self.w.act_bytes // 2

        pp_comm = self.pp_comm
        assert pp_comm is not None  # a pp layout has its pipeline communicator

        def p2p(op: str, peer: int) -> None:
            n.group_start()
            (n.send if op == "Send" else n.recv)(count, "bfloat16", peer, pp_comm, self.compute)
            n.group_end()
            self.log.coll(op, self.w.act_bytes)

        mark("fwd_start", self.compute)
        for _ in range(mbs):
            if self.stage > 0:
                p2p("Recv", self.stage - 1)
            self.model.forward(scale)
            if self.stage < last:
                p2p("Send", self.stage + 1)
        mark("fwd_end", self.compute)
        mark("bwd_start", self.compute)
        for m in range(mbs):
            if self.stage < last:
                p2p("Recv", self.stage + 1)
            self.model.backward(scale, grad_sync=(m == mbs - 1))
            if self.stage > 0:
                p2p("Send", self.stage - 1)
        self.finish_grad_sync()

    def train(self) -> None:
        for step in range(self.steps):
            self.step = step
            self.emit(self.train_step(step))
        self.cu.ctx_sync()
        self.pg.shutdown()  # the watchdog stops before its communicator goes
        for info in self.comm_info.values():
            self.nccl.destroy(info["handle"])
        self.emit({"done": {"t_ns": self.cu.now()}})


def main() -> int:
    with open(os.environ["ARGUS_SIM_CONFIG"]) as f:
        cfg = json.load(f)
    t = Trainer(cfg)
    if cfg.get("gate"):  # libraries are mapped; let a probe attach before the first CUDA call
        open(os.path.join(t.run_dir, f"ready{t.rank}"), "w").close()
        while not os.path.exists(cfg["gate"]):
            time.sleep(0.01)
    t.setup()
    t.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
