"""What a simulated rank computes: kernels, collectives and their modelled costs.

Durations are microseconds of simulated GPU time. `predict_step_s` is the cost model the
launcher and tests compare measured step times against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

# (kernel name, microseconds) per transformer layer, forward; backward is derived from it.
FWD_LAYER: List[Tuple[str, float]] = [
    ("layer_norm_fwd", 40.0),
    ("gemm_qkv_fwd", 300.0),
    ("flash_attn_fwd", 500.0),
    ("gemm_attn_proj_fwd", 150.0),
    ("layer_norm_fwd", 40.0),
    ("gemm_mlp_up_fwd", 600.0),
    ("gelu_fwd", 60.0),
    ("gemm_mlp_down_fwd", 600.0),
]
MLP_KERNELS = {"gemm_mlp_up", "gelu", "gemm_mlp_down"}


def bwd_layer(fwd: List[Tuple[str, float]]) -> List[Tuple[str, float]]:
    """Backward of a layer: GEMMs split into dgrad + wgrad, other kernels 1.5x, reversed order."""
    out: List[Tuple[str, float]] = []
    for name, us in reversed(fwd):
        base = name[: -len("_fwd")]
        if base.startswith("gemm"):
            out += [(f"{base}_dgrad", us), (f"{base}_wgrad", us)]
        else:
            out.append((f"{base}_bwd", us * 1.5))
    return out


def is_mlp(kernel: str) -> bool:
    return any(kernel.startswith(k) for k in MLP_KERNELS)


@dataclass
class Workload:
    """Per-rank work of one training step. Defaults: ~0.2 s steps, ~600 launches, ~25 collectives."""

    layers: int = 24
    data_ms: float = 15.0  # host-side data loading per step
    batch_bytes: int = 8 << 20  # host-to-device copy of the batch
    grad_bytes_per_layer: int = 24 << 20  # bf16 gradients per layer
    bucket_layers: int = 1  # layers per DDP gradient bucket (one all-reduce each)
    opt_kernels_per_layers: int = 4  # one multi_tensor_adam launch per this many layers
    opt_us: float = 800.0
    act_bytes: int = 4 << 20  # TP all-reduce / PP send size per microbatch
    microbatches: int = 4  # pipeline microbatches (pp layouts)
    tp: int = 2
    pp: int = 2
    extra_kernels_per_layer: int = 0  # tiny elementwise kernels, to raise launch rates
    grad_accum: int = 1  # micro-batches per step in dp/tp-dp (gradient accumulation)
    seq_parallel: bool = False  # tp-dp: TP all-gather/reduce-scatter pairs instead of all-reduces
    scale: float = 1.0  # multiplies every GPU duration
    # pending launches a stream holds before a launch blocks (a real driver: ~1024); 0: no limit a
    # preset reaches, so the host runs a whole step ahead of its GPU
    launch_queue: int = 0

    def fwd_layer(self) -> List[Tuple[str, float]]:
        extra = [(f"elementwise_{i}_fwd", 8.0) for i in range(self.extra_kernels_per_layer)]
        return [(n, us * self.scale) for n, us in FWD_LAYER + extra]

    def kernel_table(self) -> Dict[str, float]:
        """Every kernel name (for cuModuleGetFunction) -> ns per block (1 block = 1 us)."""
        names = [n for n, _ in self.fwd_layer()] + [n for n, _ in bwd_layer(self.fwd_layer())]
        names += ["multi_tensor_adam", "grad_norm_reduce", "cross_entropy_fwd", "cross_entropy_bwd"]
        return {n: 1000.0 for n in dict.fromkeys(names)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: Dict[str, Workload] = {
    "default": Workload(),
    # >= 2,000 launches and >= 200 collectives per rank per step (tp-dp layout)
    "heavy": Workload(layers=48, extra_kernels_per_layer=12, bucket_layers=1, data_ms=10.0, scale=0.5),
    # fast runs for tests: ~70 ms steps
    "small": Workload(layers=8, data_ms=5.0, grad_bytes_per_layer=16 << 20),
    # `tp`: one rank of a Megatron-style TP=8 x PP=2 x DP job, 8 ranks = one TP group = one host
    # (`argus sim run --ranks 8 --layout tp-dp --preset tp`). Counted from the structure of such a
    # job, not measured on one:
    # - 80 transformer layers (a 70B-class model, as Llama-2-70B); PP=2 stages: a rank runs its
    #   stage's 80 / 2 = 40 layers (layers=40). TP=8: one 8-GPU NVLink host per TP group (tp=8;
    #   the DP group within 8 simulated ranks is then a single rank).
    # - 8 micro-batches per step (grad_accum=8): Megatron runs global batch / (micro-batch x DP)
    #   micro-batches a step, e.g. 64 / (1 x 8); the figure.
    # - Sequence parallelism (seq_parallel, Megatron's --sequence-parallel; trainer.SP_*): per layer
    #   and micro-batch 4 TP collectives forward (all-gather before the QKV and MLP-up GEMMs,
    #   reduce-scatter after the attention-projection and MLP-down GEMMs) and 6 backward (all-gather
    #   of the output gradient before each row-parallel dgrad; for each column-parallel GEMM an
    #   all-gather of its saved input for the wgrad and a reduce-scatter of its dgrad):
    #   10 x 40 x 8 = 3,200 TP collectives, + 40 gradient-bucket all-reduces (one per layer) after
    #   the last micro-batch = 3,240 collectives per rank-step.
    # - Launches: the simulator's 8 kernels per layer forward and 12 backward (GEMMs as dgrad +
    #   wgrad) plus 6 small elementwise kernels each way (rotary embedding of q and k, two
    #   bias-dropout-add residuals, casts): 32 per layer and micro-batch x 320 = 10,240, + a
    #   cross-entropy forward and backward per micro-batch (16) + optimizer (11) = 10,267.
    # - Not modelled: send/recv to the other pipeline stage (2 per micro-batch, 16 per step: their
    #   peers are on another host), activation recomputation, TP communication overlapped through
    #   userbuffers (which replaces these NCCL calls). Bytes are the simulator's (act_bytes), not a
    #   70B model's activations; durations (scale=5) set the step length.
    # Measured (ground truth, rank<R>.jsonl): 10,267 launches and 3,240 collectives (1,920
    # all-gathers, 1,280 reduce-scatters, 40 all-reduces) per rank-step; steps 1.63 s with 8 ranks
    # on the 2-vCPU VM (cost model 1.61 s); the job uses ~0.4 of the 2 CPUs (3.7 CPU-s in 8.7 s).
    "tp": Workload(
        layers=40,
        tp=8,
        grad_accum=8,
        seq_parallel=True,
        extra_kernels_per_layer=6,
        bucket_layers=1,
        scale=5.0,
    ),
}


@dataclass
class StepModel:
    """Modelled per-step GPU phase times of one rank, in seconds."""

    data: float
    forward: float
    backward: float
    optimizer: float
    comm_exposed: float
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (
            self.data
            + self.forward
            + self.backward
            + self.optimizer
            + self.comm_exposed
            + sum(self.extra.values())
        )


def allreduce_s(nbytes: int, n: int, alpha_us: float = 8.0, bw_gbps: float = 150.0) -> float:
    """Ring all-reduce, alpha-beta model (same as the simulated libnccl)."""
    if n <= 1:
        return 2e-6
    return (2 * (n - 1) * alpha_us * 1e3 + 2 * (n - 1) / n * nbytes / bw_gbps) / 1e9


def gather_s(shard_bytes: int, n: int, alpha_us: float = 8.0, bw_gbps: float = 150.0) -> float:
    """Ring all-gather or reduce-scatter of n shards of shard_bytes (same as the simulated libnccl)."""
    if n <= 1:
        return 2e-6
    return ((n - 1) * alpha_us * 1e3 + (n - 1) * shard_bytes / bw_gbps) / 1e9


def predict_step_s(
    w: Workload,
    layout: str,
    world: int,
    compute_factor: float = 1.0,
    mlp_factor: float = 1.0,
    bwd_factor: float = 1.0,
) -> StepModel:
    """Step time of the slowest rank in steady state for a DP-style layout.

    compute_factor scales every kernel of the slowest rank, mlp_factor only its MLP kernels,
    bwd_factor only its backward. Good for dp and tp-dp; pp-dp adds bubbles (see trainer).
    """
    tp = w.tp if layout == "tp-dp" else 1
    pp = w.pp if layout == "pp-dp" else 1
    layers = w.layers // pp

    def cost(kernels: List[Tuple[str, float]], extra_factor: float) -> float:
        return (
            sum(us * compute_factor * extra_factor * (mlp_factor if is_mlp(n) else 1.0) for n, us in kernels)
            / 1e6
        )

    fwd = cost(w.fwd_layer(), 1.0) * layers + 50e-6 * w.scale
    bwd = cost(bwd_layer(w.fwd_layer()), bwd_factor) * layers + 50e-6 * w.scale
    n_opt = max(1, layers // w.opt_kernels_per_layers)
    opt = (n_opt * w.opt_us * w.scale + 100 * w.scale) * compute_factor / 1e6
    dp = max(1, world // (tp * pp))
    bucket = w.grad_bytes_per_layer * w.bucket_layers // tp
    comm = allreduce_s(bucket, dp)
    extra: Dict[str, float] = {}
    if tp > 1 and w.seq_parallel:  # 4 forward + 6 backward per layer and micro-batch (trainer)
        extra["tp_comm"] = 10 * layers * w.grad_accum * gather_s(w.act_bytes // 2 // tp, tp)
    elif tp > 1:
        extra["tp_comm"] = 4 * layers * w.grad_accum * allreduce_s(w.act_bytes, tp)
    copy = (2000 + w.batch_bytes / 25.0) / 1e9
    return StepModel(w.data_ms / 1e3 + copy, fwd, bwd, opt, comm, extra)
