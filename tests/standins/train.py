"""One rank of a stand-in training job, driving the stand-in libcuda/libnccl through ctypes.

Standard library only, so that it runs under any interpreter (job.py starts it by path). The
rank reads RANK / WORLD_SIZE / LOCAL_RANK and TORCHELASTIC_RUN_ID as torchrun sets them, finds
the libraries in $STANDIN_LIBDIR, and writes its ground truth to rank<R>.jsonl in the run
directory (the current directory unless --run-dir): a "loaded" line, a "meta" line, one "step"
line per step, then "done" (or "hang" / "error"). Steps are numbered from 0.

Layouts:
  dp     one all-reduce communicator of all ranks; per step: data (host sleep + HtoD copy),
         forward kernels, backward kernels with the gradient all-reduced in buckets as backward
         produces them, optimizer kernels, then a loss.item()-like DtoH copy and a stream sync.
  pp-dp  two pipeline stages: global ranks (2i, 2i+1) form a pipeline communicator (1F1B with
         activations sent forward and gradients backward, grouped send/recv in the steady state),
         and the ranks of one stage form a data-parallel communicator.

train_async.py (the async variant) builds on this file: its rank is a subclass of `Rank` that
overrides the hooks `create_streams`, `allreduce`, `wait_for_grads`, `meta_extra`, `step_extra`,
`before_steps`, `after_steps` and `teardown`, and its `main` is `run_rank` with its own class.

Run by hand (from a scratch directory; see README.md):
  STANDIN_LIBDIR=$(python -m tests.standins.build) RANK=0 WORLD_SIZE=1 python train.py --steps 3
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Type

LAYOUTS = ("dp", "pp-dp")

# ------------------------------------------------------------------------------------ fault specs

# kind -> (required keys, optional keys)
FAULT_KEYS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "straggler": (("rank", "factor"), ("from_step",)),
    "slow_link": (("ranks", "factor"), ("from_step",)),
    "bubble": (("rank", "factor"), ("from_step",)),
    "host_stall": (("rank", "step", "seconds"), ()),
    "hang": (("rank", "step"), ()),
}
SPEC_HELP = (
    "straggler:rank=R,factor=F[,from_step=S] | slow_link:ranks=A-B,factor=F[,from_step=S] | "
    "bubble:rank=R,factor=F[,from_step=S] | host_stall:rank=R,step=S,seconds=T | hang:rank=R,step=S"
)


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    ranks: Tuple[int, ...]
    onset_step: int
    factor: float = 1.0
    seconds: float = 0.0
    spec: str = ""

    def active(self, step: int) -> bool:
        """Whether the fault affects `step` (one-shot kinds only their own step)."""
        if self.kind in ("host_stall", "hang"):
            return step == self.onset_step
        return step >= self.onset_step

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"kind": self.kind, "ranks": list(self.ranks), "onset_step": self.onset_step}
        if self.kind in ("straggler", "slow_link", "bubble"):
            d["factor"] = self.factor
        if self.kind == "host_stall":
            d["seconds"] = self.seconds
        d["spec"] = self.spec
        return d


def _int(spec: str, key: str, v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise SpecError(f"bad fault spec {spec!r}: {key}={v!r} is not an integer") from None
    if n < 0:
        raise SpecError(f"bad fault spec {spec!r}: {key} must be >= 0")
    return n


def _float(spec: str, key: str, v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise SpecError(f"bad fault spec {spec!r}: {key}={v!r} is not a number") from None
    if not x > 0:
        raise SpecError(f"bad fault spec {spec!r}: {key} must be > 0")
    return x


def parse_fault(
    spec: str, world: Optional[int] = None, steps: Optional[int] = None, layout: Optional[str] = None
) -> Fault:
    """Parse and validate one `KIND:key=value,...` spec (ranks/steps checked when given)."""
    kind, sep, rest = spec.strip().partition(":")
    if kind not in FAULT_KEYS:
        raise SpecError(f"bad fault spec {spec!r}: unknown kind {kind!r} (expected {SPEC_HELP})")
    required, optional = FAULT_KEYS[kind]
    kv: Dict[str, str] = {}
    for item in rest.split(",") if sep and rest.strip() else []:
        key, eq, value = item.strip().partition("=")
        if not eq or not value:
            raise SpecError(f"bad fault spec {spec!r}: {item!r} is not key=value")
        if key not in required + optional:
            raise SpecError(f"bad fault spec {spec!r}: unknown key {key!r} for {kind} (expected {SPEC_HELP})")
        if key in kv:
            raise SpecError(f"bad fault spec {spec!r}: {key} given twice")
        kv[key] = value
    missing = [k for k in required if k not in kv]
    if missing:
        raise SpecError(f"bad fault spec {spec!r}: missing {', '.join(missing)} (expected {SPEC_HELP})")
    if kind == "slow_link":
        a, dash, b = kv["ranks"].partition("-")
        if not dash:
            raise SpecError(f"bad fault spec {spec!r}: ranks must be A-B")
        ranks: Tuple[int, ...] = (_int(spec, "ranks", a), _int(spec, "ranks", b))
        if ranks[0] == ranks[1]:
            raise SpecError(f"bad fault spec {spec!r}: a link needs two different ranks")
    else:
        ranks = (_int(spec, "rank", kv["rank"]),)
    onset = (
        _int(spec, "step", kv["step"]) if "step" in kv else _int(spec, "from_step", kv.get("from_step", "0"))
    )
    factor = _float(spec, "factor", kv["factor"]) if "factor" in kv else 1.0
    seconds = _float(spec, "seconds", kv["seconds"]) if "seconds" in kv else 0.0
    if world is not None and any(r >= world for r in ranks):
        raise SpecError(f"bad fault spec {spec!r}: rank out of range for a world of {world}")
    if steps is not None and onset >= steps:
        raise SpecError(f"bad fault spec {spec!r}: step {onset} is past the last step ({steps - 1})")
    if kind == "bubble" and layout is not None and layout != "pp-dp":
        raise SpecError(f"bad fault spec {spec!r}: a pipeline bubble needs layout pp-dp")
    return Fault(kind, ranks, onset, factor, seconds, spec.strip())


# ------------------------------------------------------------------------------------ the model

# (name, ns per thread block): the module image gives every kernel its cost; a launch's grid size
# sets how much work it is. Names look like what a transformer step launches.
KERNELS: Tuple[Tuple[str, int], ...] = (
    ("embedding_fwd_kernel", 300),
    ("layernorm_fwd_kernel", 400),
    ("sm90_gemm_bf16_qkv_fprop", 1800),
    ("flash_fwd_kernel", 3000),
    ("sm90_gemm_bf16_mlp_fprop", 2400),
    ("cross_entropy_fwd_kernel", 500),
    ("cross_entropy_bwd_kernel", 500),
    ("sm90_gemm_bf16_mlp_dgrad", 2400),
    ("sm90_gemm_bf16_mlp_wgrad", 2400),
    ("flash_bwd_kernel", 6000),
    ("sm90_gemm_bf16_qkv_dgrad", 1800),
    ("sm90_gemm_bf16_qkv_wgrad", 1800),
    ("layernorm_bwd_kernel", 400),
    ("multi_tensor_l2norm_kernel", 1000),
    ("multi_tensor_adam_kernel", 4000),
)
# per transformer layer: (kernel, blocks) for one full batch
LAYER_FWD = (
    ("layernorm_fwd_kernel", 256),
    ("sm90_gemm_bf16_qkv_fprop", 512),
    ("flash_fwd_kernel", 256),
    ("sm90_gemm_bf16_mlp_fprop", 512),
)
LAYER_BWD = (
    ("sm90_gemm_bf16_mlp_dgrad", 512),
    ("sm90_gemm_bf16_mlp_wgrad", 512),
    ("flash_bwd_kernel", 256),
    ("sm90_gemm_bf16_qkv_dgrad", 512),
    ("sm90_gemm_bf16_qkv_wgrad", 512),
    ("layernorm_bwd_kernel", 256),
)
BACKWARD = frozenset(k for k, _ in LAYER_BWD) | {"cross_entropy_bwd_kernel"}
LAYERS = 8  # the dp model; pp-dp puts half on each stage
DP_BUCKETS = 4  # gradient buckets, all-reduced as backward reaches them
BUCKET_ELEMS = 16 << 20  # fp32 gradients per bucket (64 MiB)
PP_MICROBATCHES = 4
PP_MB_SHARE = 2  # a microbatch is 1/2 of the dp batch: pipelines run bigger global batches
PP_BUCKETS = 2
ACT_ELEMS = 4 << 20  # bf16 activations (and their gradients) per microbatch: 8 MiB
DATA_WAIT_S = 0.008  # the data loader's share of a step (host sleep)
BATCH_BYTES = 1 << 20  # token ids copied host to device each step
NCCL_FLOAT32, NCCL_BFLOAT16, NCCL_SUM = 7, 9, 0


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: CUresult {code} ({text})")
        self.call, self.code = call, code


class NcclError(RuntimeError):
    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: ncclResult_t {code} ({text})")
        self.call, self.code = call, code


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]  # ncclUniqueId: passed by value


def load_libraries(libdir: str) -> Tuple[ctypes.CDLL, ctypes.CDLL]:
    """Both libraries, loaded by path so that /proc/PID/maps names them. libcuda first: the stand-in
    libnccl finds it by soname among the loaded libraries."""
    cuda = ctypes.CDLL(os.path.join(libdir, "libcuda.so.1"))
    nccl = ctypes.CDLL(os.path.join(libdir, "libnccl.so.2"))
    vp, u, sz, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int
    cuda.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
    cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), sz]
    cuda.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, vp, sz, vp]
    cuda.cuMemcpyDtoHAsync_v2.argtypes = [vp, ctypes.c_uint64, sz, vp]
    cuda.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    cuda.cuStreamSynchronize.argtypes = [vp]
    cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
    cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
    cuda.standinScaleKernel.argtypes = [vp, ctypes.c_double]
    cuda.cuGetErrorString.argtypes = [i, ctypes.POINTER(ctypes.c_char_p)]
    nccl.ncclAllReduce.argtypes = [ctypes.c_uint64, ctypes.c_uint64, sz, i, i, vp, vp]
    nccl.ncclSend.argtypes = [ctypes.c_uint64, sz, i, i, vp, vp]
    nccl.ncclRecv.argtypes = [ctypes.c_uint64, sz, i, i, vp, vp]
    nccl.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
    nccl.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, UniqueId, i]
    nccl.ncclCommDestroy.argtypes = [vp]
    nccl.ncclCommCount.argtypes = [vp, ctypes.POINTER(i)]
    nccl.ncclCommUserRank.argtypes = [vp, ctypes.POINTER(i)]
    nccl.ncclGetErrorString.restype = ctypes.c_char_p
    nccl.standinSetLinkFactor.argtypes = [i, i, ctypes.c_double]
    return cuda, nccl


@dataclass
class Comm:
    name: str
    members: Tuple[int, ...]  # global ranks, in comm-rank order
    rank: int
    handle: ctypes.c_void_p


class Rank:
    def __init__(self, args: argparse.Namespace, truth: IO[str]) -> None:
        # --rank/--world-size: what a script passes to init_process_group (nothing in the environment)
        self.rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
        self.world = (
            args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        )
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))
        self.job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        self.layout: str = args.layout
        self.steps: int = args.steps
        self.run_dir = Path(args.run_dir)
        self.truth = truth
        self.faults = [parse_fault(s, self.world, self.steps, self.layout) for s in args.inject]
        if self.layout == "pp-dp" and self.world % 2:
            raise SystemExit("pp-dp needs an even WORLD_SIZE")
        libdir = os.environ.get("STANDIN_LIBDIR")
        if not libdir:
            raise SystemExit("STANDIN_LIBDIR is not set (python -m tests.standins.build prints it)")
        self.cuda, self.nccl = load_libraries(libdir)
        self.write(kind="loaded", pid=os.getpid(), rank=self.rank, libdir=libdir)
        self.comms: Dict[str, Comm] = {}
        self.funcs: Dict[str, ctypes.c_void_p] = {}
        self.step = -1

    # -------------------------------------------------------------------- plumbing

    def write(self, **fields: Any) -> None:
        self.truth.write(json.dumps(fields) + "\n")
        self.truth.flush()

    def cu(self, name: str, *args: Any) -> None:
        rc = getattr(self.cuda, name)(*args)
        if rc != 0:
            s = ctypes.c_char_p()
            self.cuda.cuGetErrorString(rc, ctypes.byref(s))
            raise CudaError(name, rc, (s.value or b"?").decode())

    def nc(self, name: str, *args: Any) -> None:
        rc = getattr(self.nccl, name)(*args)
        if rc != 0:
            raise NcclError(name, rc, self.nccl.ncclGetErrorString(rc).decode())

    def gate(self) -> None:
        """Wait for the job's release file: a tracer can attach before the first CUDA call."""
        release = self.run_dir / "release"
        while not release.exists():
            time.sleep(0.02)

    # -------------------------------------------------------------------- setup

    def setup_cuda(self) -> None:
        self.cu("cuInit", 0)
        n = ctypes.c_int()
        self.cu("cuDeviceGetCount", ctypes.byref(n))
        dev = ctypes.c_int()
        self.cu("cuDeviceGet", ctypes.byref(dev), self.local_rank % n.value)
        self.ctx = ctypes.c_void_p()
        self.cu("cuCtxCreate_v2", ctypes.byref(self.ctx), 0, dev)
        self.cu("cuCtxSetCurrent", self.ctx)
        self.create_streams()
        image = "standin-module v1\n" + "".join(f"kernel {k} {ns}\n" for k, ns in KERNELS)
        module = ctypes.c_void_p()
        self.cu("cuModuleLoadData", ctypes.byref(module), image.encode())
        for name, _ in KERNELS:
            f = ctypes.c_void_p()
            self.cu("cuModuleGetFunction", ctypes.byref(f), module, name.encode())
            self.funcs[name] = f
        self.batch_host = ctypes.create_string_buffer(BATCH_BYTES)
        self.loss_host = ctypes.c_float()
        self.batch_dev = self.alloc(BATCH_BYTES)
        self.loss_dev = self.alloc(4)
        buckets = DP_BUCKETS if self.layout == "dp" else PP_BUCKETS
        self.grads = [self.alloc(BUCKET_ELEMS * 4) for _ in range(buckets)]
        self.acts = (
            [self.alloc(ACT_ELEMS * 2) for _ in range(PP_MICROBATCHES)] if self.layout == "pp-dp" else []
        )

    def create_streams(self) -> None:
        """Hook: the stream kernels and copies go to (`self.stream`); here NCCL uses it too."""
        self.stream = ctypes.c_void_p()
        self.cu("cuStreamCreate", ctypes.byref(self.stream), 1)  # CU_STREAM_NON_BLOCKING

    def alloc(self, nbytes: int) -> int:
        p = ctypes.c_uint64()
        self.cu("cuMemAlloc_v2", ctypes.byref(p), nbytes)
        return p.value

    def unique_id(self, name: str, root: bool) -> UniqueId:
        """File rendezvous: the comm's root writes the id, the others poll for it."""
        path = self.run_dir / f"comm-{name}.uid"
        uid = UniqueId()
        if root:
            self.nc("ncclGetUniqueId", ctypes.byref(uid))
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(bytes(uid))
            os.replace(tmp, path)
            return uid
        while not path.exists():
            time.sleep(0.01)
        ctypes.memmove(ctypes.byref(uid), path.read_bytes(), 128)
        return uid

    def make_comm(self, name: str, members: Sequence[int]) -> None:
        members = tuple(members)
        me = members.index(self.rank)
        uid = self.unique_id(name, me == 0)
        handle = ctypes.c_void_p()
        self.nc("ncclCommInitRank", ctypes.byref(handle), len(members), uid, me)
        n, r = ctypes.c_int(), ctypes.c_int()
        self.nc("ncclCommCount", handle, ctypes.byref(n))
        self.nc("ncclCommUserRank", handle, ctypes.byref(r))
        assert (n.value, r.value) == (len(members), me), (n.value, r.value)
        self.comms[name] = Comm(name, members, me, handle)

    def setup_comms(self) -> None:
        if self.layout == "dp":
            self.make_comm("dp", range(self.world))
            return
        # pipeline pairs first, then the per-stage data-parallel groups: the same order everywhere
        pair = self.rank // 2
        self.make_comm(f"pp{pair}", (2 * pair, 2 * pair + 1))
        stage = self.rank % 2
        self.make_comm(f"dp-stage{stage}", range(stage, self.world, 2))

    # -------------------------------------------------------------------- work

    def launch(self, name: str, blocks: int) -> None:
        self.cu(
            "cuLaunchKernel", self.funcs[name], max(1, blocks), 1, 1, 256, 1, 1, 0, self.stream, None, None
        )

    def layer_fwd(self, share: int = 1) -> None:
        for k, blocks in LAYER_FWD:
            self.launch(k, blocks // share)

    def layer_bwd(self, share: int = 1) -> None:
        for k, blocks in LAYER_BWD:
            self.launch(k, blocks // share)

    def data(self) -> None:
        time.sleep(DATA_WAIT_S)
        src = ctypes.addressof(self.batch_host)
        self.cu("cuMemcpyHtoDAsync_v2", self.batch_dev, src, BATCH_BYTES, self.stream)

    def allreduce(self, comm: Comm, buf: int, bucket: int) -> None:
        """Hook: one gradient bucket's all-reduce (a hang fault strikes before a step's first)."""
        if bucket == 0:
            self.maybe_hang()
        self.nc("ncclAllReduce", buf, buf, BUCKET_ELEMS, NCCL_FLOAT32, NCCL_SUM, comm.handle, self.stream)

    def wait_for_grads(self) -> None:
        """Hook: before the optimizer, make it wait for the all-reduces (here they blocked already)."""

    def optimizer_and_loss(self) -> None:
        self.launch("multi_tensor_l2norm_kernel", 256)
        for _ in self.grads:
            self.launch(
                "multi_tensor_adam_kernel", 1024 // (1 if self.layout == "dp" else 2) // len(self.grads)
            )
        # loss.item(): a small DtoH copy and a host sync, the end of every step
        self.cu("cuMemcpyDtoHAsync_v2", ctypes.addressof(self.loss_host), self.loss_dev, 4, self.stream)
        self.cu("cuStreamSynchronize", self.stream)

    def dp_step(self) -> None:
        comm = self.comms["dp"]
        self.data()
        self.maybe_stall()
        self.launch("embedding_fwd_kernel", 128)
        for _ in range(LAYERS):
            self.layer_fwd()
        self.launch("cross_entropy_fwd_kernel", 64)
        self.launch("cross_entropy_bwd_kernel", 64)
        per_bucket = LAYERS // DP_BUCKETS
        for i in range(LAYERS):
            self.layer_bwd()
            if (i + 1) % per_bucket == 0:
                b = i // per_bucket
                self.allreduce(comm, self.grads[b], b)
        self.wait_for_grads()
        self.optimizer_and_loss()

    def pp_step(self) -> None:
        """1F1B over two stages; stage 0 sends activations to stage 1 and receives gradients."""
        pp = self.comms[f"pp{self.rank // 2}"]
        dp = self.comms[f"dp-stage{self.rank % 2}"]
        stage, m = self.rank % 2, PP_MICROBATCHES
        peer = 1 - pp.rank
        self.data()
        self.maybe_stall()

        def fwd(mb: int) -> None:
            if stage == 0:
                self.launch("embedding_fwd_kernel", 128 // PP_MB_SHARE)
            for _ in range(LAYERS // 2):
                self.layer_fwd(PP_MB_SHARE)
            if stage == 1:
                self.launch("cross_entropy_fwd_kernel", 64 // PP_MB_SHARE)

        def bwd(mb: int) -> None:
            if stage == 1:
                self.launch("cross_entropy_bwd_kernel", 64 // PP_MB_SHARE)
            for _ in range(LAYERS // 2):
                self.layer_bwd(PP_MB_SHARE)

        def send(mb: int) -> None:
            self.nc("ncclSend", self.acts[mb], ACT_ELEMS, NCCL_BFLOAT16, peer, pp.handle, self.stream)

        def recv(mb: int) -> None:
            self.nc("ncclRecv", self.acts[mb], ACT_ELEMS, NCCL_BFLOAT16, peer, pp.handle, self.stream)

        def grouped(send_mb: int, recv_mb: int) -> None:
            self.nc("ncclGroupStart")
            send(send_mb)
            recv(recv_mb)
            self.nc("ncclGroupEnd")

        if stage == 0:
            fwd(0)
            send(0)
            for i in range(m - 1):
                fwd(i + 1)
                grouped(i + 1, i)  # send activations of mb i+1, receive gradients of mb i
                bwd(i)
            recv(m - 1)
            bwd(m - 1)
        else:
            recv(0)
            for i in range(m):
                fwd(i)
                bwd(i)
                if i < m - 1:
                    grouped(i, i + 1)  # send gradients of mb i, receive activations of mb i+1
                else:
                    send(i)
        for b, g in enumerate(self.grads):
            self.allreduce(dp, g, b)
        self.optimizer_and_loss()

    # -------------------------------------------------------------------- faults

    def mine(self, f: Fault) -> bool:
        return self.rank in f.ranks

    def apply_onsets(self, step: int) -> None:
        for f in self.faults:
            if f.onset_step != step:
                continue
            if f.kind == "straggler" and self.mine(f):
                self.cu("standinScaleKernel", None, f.factor)
            elif f.kind == "bubble" and self.mine(f):
                for k in BACKWARD:
                    self.cu("standinScaleKernel", self.funcs[k], f.factor)
            elif f.kind == "slow_link":  # every rank: their transfer models must agree
                self.nc("standinSetLinkFactor", f.ranks[0], f.ranks[1], f.factor)

    def maybe_stall(self) -> None:
        for f in self.faults:
            if f.kind == "host_stall" and self.mine(f) and f.active(self.step):
                end = time.monotonic() + f.seconds
                x = 0
                while time.monotonic() < end:  # CPU-bound on purpose: a stall the CPU sees
                    x = (x * 31 + 7) % 1000003

    def maybe_hang(self) -> None:
        for f in self.faults:
            if f.kind == "hang" and self.mine(f) and f.active(self.step):
                self.write(kind="hang", step=self.step, mono_ns=time.monotonic_ns(), wall_ns=time.time_ns())
                while True:  # a live rank that never arrives: its peers block in ncclAllReduce
                    time.sleep(3600)

    # -------------------------------------------------------------------- main

    def run(self, gated: bool) -> None:
        if gated:
            self.gate()
        self.setup_cuda()
        self.setup_comms()
        self.write(
            kind="meta",
            pid=os.getpid(),
            rank=self.rank,
            world=self.world,
            local_rank=self.local_rank,
            layout=self.layout,
            job=self.job,
            steps=self.steps,
            **self.meta_extra(),
            comms=[
                {"name": c.name, "nranks": len(c.members), "rank": c.rank, "members": list(c.members)}
                for c in self.comms.values()
            ],
            faults=[f.to_json() for f in self.faults],
        )
        self.before_steps()
        cpu0, wall0 = time.process_time(), time.monotonic()
        for step in range(self.steps):
            self.step = step
            self.apply_onsets(step)
            t0, w0 = time.monotonic_ns(), time.time_ns()
            if self.layout == "dp":
                self.dp_step()
            else:
                self.pp_step()
            t1, w1 = time.monotonic_ns(), time.time_ns()
            self.write(
                kind="step",
                step=step,
                start_mono_ns=t0,
                end_mono_ns=t1,
                start_wall_ns=w0,
                end_wall_ns=w1,
                faults=[f.kind for f in self.faults if f.active(step)],
                **self.step_extra(),
            )
        self.after_steps()
        self.write(
            kind="done",
            steps=self.steps,
            cpu_s=round(time.process_time() - cpu0, 4),
            wall_s=round(time.monotonic() - wall0, 4),
            mono_ns=time.monotonic_ns(),
        )
        self.teardown()
        for c in self.comms.values():
            self.nc("ncclCommDestroy", c.handle)

    # hooks around the step loop (a variant's additions; nothing here)

    def meta_extra(self) -> Dict[str, Any]:
        """Fields of the `meta` line after `steps`."""
        return {}

    def step_extra(self) -> Dict[str, Any]:
        """Fields at the end of the `step` line of the step just finished."""
        return {}

    def before_steps(self) -> None:
        """After the `meta` line, before the first step."""

    def after_steps(self) -> None:
        """After the last step, before the `done` line."""

    def teardown(self) -> None:
        """After the `done` line, before the communicators are destroyed."""

    def write_error(self, call: str, code: int, message: str) -> None:
        """The `error` line: a CUDA or NCCL call failed."""
        self.write(
            kind="error",
            step=self.step,
            call=call,
            code=code,
            message=message,
            mono_ns=time.monotonic_ns(),
            wall_ns=time.time_ns(),
        )


def main(argv: Optional[List[str]] = None) -> int:
    return run_rank(argv, Rank, "one rank of a stand-in training job", LAYOUTS)


def run_rank(
    argv: Optional[List[str]], rank_class: Type[Rank], description: str, layouts: Sequence[str]
) -> int:
    """A trainer's command line: parse it, open rank<R>.jsonl, run `rank_class`; the exit code."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--layout", choices=layouts, default="dp")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--inject", action="append", default=[], metavar="SPEC", help=SPEC_HELP)
    p.add_argument("--run-dir", default=".")
    p.add_argument("--gate", action="store_true", help="load the libraries, then wait for RUN_DIR/release")
    p.add_argument("--rank", type=int, default=None, help="this rank (default: RANK)")
    p.add_argument("--world-size", type=int, default=None, help="ranks in the job (default: WORLD_SIZE)")
    args = p.parse_args(argv)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    with open(Path(args.run_dir) / f"rank{rank}.jsonl", "a") as truth:
        try:
            r = rank_class(args, truth)
        except SpecError as e:
            print(e, file=sys.stderr)
            return 2
        try:
            r.run(args.gate)
        except (CudaError, NcclError) as e:
            print(f"rank {rank}: {e}", file=sys.stderr)
            r.write_error(e.call, e.code, str(e))
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
