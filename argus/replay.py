"""`argus replay`: publish recorded (or synthetic) summaries to Redis, as agents would.

Recorded: a JSONL file of `argus probe --json` output, read by `argus.schema.read_jsonl`.
Synthetic: `synthetic_steps()` makes realistic RankSteps for any number of ranks (kernels, a DP
communicator with ~24 collectives per step and arrival jitter, an optional straggler) so the
aggregator can be driven at 1,024 or 10,000 ranks without BPF. Unlike the agent's publisher,
replay never drops: it waits for Redis (pipelined, in batches), since nobody is slowed by it.
"""

from __future__ import annotations

import math
import random
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Iterator, List, Optional, Set, Tuple

import click

from argus import redisconf, wire
from argus.errors import RedisUnavailable, UsageError

# (name, launches per layer per step): long, realistic names (interning matters for the budget)
from argus.rediskeys import K_JOBS
from argus.schema import CommStep, RankStep, read_jsonl
from argus.transport import STEPS_MAXLEN, write_names, write_steps

KERNELS: List[Tuple[str, int]] = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_kernel", 4),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize256x128x64_warpgroupsize2x1x1_execute_kernel", 4),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>", 1),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8>>", 1),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl, at::Array>", 2),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", 2),
    ("void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<c10::BFloat16>", 2),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<CUDAFunctor_add>>", 3),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<c10::BFloat16, float>, float>", 0),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float>>>", 0),
    ("void cross_entropy_loss_fwd_kernel<c10::BFloat16, float, 1024>", 0),
    ("void cross_entropy_loss_bwd_kernel<c10::BFloat16, float, 1024>", 0),
]
FIXED = {8: 6, 9: 1, 10: 1, 11: 1}  # kernels launched a fixed number of times per step


@dataclass
class Straggler:
    rank: int
    factor: float = 1.5  # its compute takes this much longer
    from_step: int = 0
    to_step: Optional[int] = None  # slow until this step (exclusive); None: to the end


@dataclass
class ReplayStats:
    entries: int = 0
    bytes: int = 0
    seconds: float = 0.0
    sizes: List[int] = field(default_factory=list)


def _variants(rng: random.Random, n: int, k: int, median: float, sigma: float) -> List[List[int]]:
    out = []
    for _ in range(n):
        xs = [max(1, round(rng.lognormvariate(math.log(median), sigma))) for _ in range(k)]
        if rng.random() < 0.3:  # an occasional slow enqueue (allocator, lock): a second mode
            xs[rng.randrange(k)] *= 12
        out.append(xs)
    return out


def synthetic_steps(
    job: str,
    ranks: int,
    steps: int,
    *,
    seed: int = 0,
    step_ms: float = 200.0,
    collectives: int = 24,
    layers: int = 24,
    straggler: Optional[Straggler] = None,
    ranks_per_host: int = 8,
    start_ns: Optional[int] = None,
    jitter_us: float = 20.0,
    first_step: int = 0,
    tp: int = 1,
    tp_collectives: int = 8,
) -> Iterator[RankStep]:
    """RankSteps of a synchronous data-parallel job, step by step (all ranks of step s, then s+1).

    Per step and rank: 12 kernels (~600 launches), a DP communicator of all ranks with
    `collectives` all-reduces issued during backward (arrival jitter ~`jitter_us`), GPU timers
    (forward, backward, optimizer, comm stream), host wait. A straggler's compute is `factor`
    slower from `from_step` on: it arrives late at every all-reduce, and every rank's step is as
    long as the straggler's (they wait for it in the final sync); with `to_step` it recovers there.

    `tp` > 1: tensor parallelism too, the layout of a TP x DP job: ranks tp·k … tp·k + tp − 1 share
    a TP communicator (`tp_collectives` all-reduces in forward and backward), and the ranks with
    the same r mod tp one DP communicator (stride tp) instead of all ranks sharing one."""
    if ranks < 1 or steps < 0 or tp < 1 or ranks % tp:
        raise ValueError("ranks must be >= 1, steps >= 0, tp >= 1 and divide ranks")
    rng = random.Random(seed)
    pool = _variants(rng, 32, collectives, 2_000.0, 0.25)
    comm = f"{zlib.crc32(job.encode()):08x}{zlib.crc32(b'dp' + job.encode()):08x}"
    # with tp: one DP communicator per TP position, one TP communicator per TP group
    dp_comms = [comm[:8] + f"{zlib.crc32(b'dp' + job.encode()) ^ i:08x}" for i in range(tp)]
    tp_comms = [comm[:8] + f"{zlib.crc32(f'tp{g}'.encode() + job.encode()):08x}" for g in range(ranks // tp)]
    kernels = {name: FIXED.get(i, per * layers) for i, (name, per) in enumerate(KERNELS)}
    launches = sum(kernels.values())
    step_ns = step_ms * 1e6
    t = start_ns if start_ns is not None else time.time_ns() - int(steps * step_ns * 1.1)
    host_offsets = [rng.randrange(10**15, 10**15 + 10**12) for _ in range((ranks - 1) // ranks_per_host + 1)]
    for s in range(first_step, first_step + steps):
        slow_rank, factor = -1, 1.0
        if straggler and s >= straggler.from_step and (straggler.to_step is None or s < straggler.to_step):
            slow_rank, factor = straggler.rank, straggler.factor
        factors = [(factor if r == slow_rank else 1.0) * rng.lognormvariate(0.0, 0.004) for r in range(ranks)]
        slowest = max(factors)
        duration = int(step_ns * (0.05 + 0.88 * slowest + 0.03)) + rng.randrange(0, 50_000)
        for r in range(ranks):
            f = factors[r]
            start = t + int(abs(rng.gauss(0.0, 3_000.0)))
            fwd, bwd, opt = 0.30 * step_ns * f, 0.55 * step_ns * f, 0.03 * step_ns * f
            data = 0.05 * step_ns
            host_ns = pool[(r * 7 + s) % len(pool)]
            arrive = [
                start + int(data + fwd + (k + 1) / collectives * bwd + abs(rng.gauss(0.0, jitter_us * 1e3)))
                for k in range(collectives)
            ]
            c = CommStep(
                dp_comms[r % tp],
                ranks // tp,
                r // tp,
                "init",
                seqs=list(range(s * collectives, (s + 1) * collectives)),
                ops=["AllReduce"] * collectives,
                nbytes=[25_165_824] * collectives,
                arrive_ns=arrive,
                host_ns=list(host_ns),
            )
            comms = {c.comm: c}
            if tp > 1:
                k = tp_collectives
                t_arrive = [
                    start + int(data + (j + 1) / k * (fwd + bwd) + abs(rng.gauss(0.0, jitter_us * 1e3)))
                    for j in range(k)
                ]
                tc = CommStep(
                    tp_comms[r // tp],
                    tp,
                    r % tp,
                    "init",
                    seqs=list(range(s * k, (s + 1) * k)),
                    ops=["AllReduce"] * k,
                    nbytes=[8_388_608] * k,
                    arrive_ns=t_arrive,
                    host_ns=list(host_ns[:k]),
                )
                comms[tc.comm] = tc
            wait = max(0, duration - int(data) - int(0.04 * step_ns))
            yield RankStep(
                job=job,
                rank=r,
                host=f"node-{r // ranks_per_host}",
                pid=10_000 + r,
                step=s,
                start_ns=start,
                duration_ns=duration,
                local_rank=r % ranks_per_host,
                world_size=ranks,
                clock_offset_ns=host_offsets[r // ranks_per_host],
                clock_uncertainty_ns=1_000,
                sync_count=1,
                sync_wait_ns=wait,
                phases={
                    "timer0": int(fwd),
                    "timer1": int(bwd),
                    "timer2": int(opt),
                    "timer3": int(0.55 * step_ns * slowest),
                    "host_wait": wait,
                    "host_other": duration - wait,
                },
                launches=launches,
                kernels=dict(kernels),
                memcpy={"HtoD": (1, 8 << 20), "DtoH": (1, 4)},
                comms=comms,
            )
        t += duration + 100_000


def load_jsonl(f: IO[str], name: str = "FILE") -> Iterator[RankStep]:
    """The RankSteps of a recorded file (argus.schema.read_jsonl; heartbeat lines left out)."""
    return (x for x in read_jsonl(f, name) if isinstance(x, RankStep))


def publish_all(
    client: Any,
    steps: Iterable[RankStep],
    *,
    job: Optional[str] = None,
    rate: float = 0.0,
    batch: int = 256,
    maxlen: int = STEPS_MAXLEN,
) -> ReplayStats:
    """XADD every step (names first), pipelined in batches, at most `rate` entries/s (0: no limit)."""
    import redis

    st = ReplayStats()
    sent_names: Set[Tuple[str, int]] = set()
    jobs: Set[str] = set()
    t0 = time.monotonic()
    pending: List[Tuple[str, bytes]] = []
    names: List[Tuple[str, int, str]] = []

    def flush() -> None:
        pipe = client.pipeline(transaction=False)
        write_names(pipe, names)
        write_steps(pipe, pending, maxlen)
        for j in jobs:
            pipe.sadd(K_JOBS, j)
        try:
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnavailable(f"Redis: {e}", redisconf.connection_hint(e)) from None
        st.entries += len(pending)
        pending.clear()
        names.clear()
        if rate > 0:
            ahead = t0 + st.entries / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)

    for rs in steps:
        if job is not None:
            rs.job = job
        jobs.add(rs.job)
        for nid, name in wire.step_names(rs).items():
            if (rs.job, nid) not in sent_names:
                sent_names.add((rs.job, nid))
                names.append((rs.job, nid, name))
        data = wire.encode_step(rs)
        st.bytes += len(data)
        st.sizes.append(len(data))
        pending.append((rs.job, data))
        if len(pending) >= (batch if rate <= 0 else max(1, min(batch, int(rate / 10) or 1))):
            flush()
    if pending or names:
        flush()
    st.seconds = time.monotonic() - t0
    return st


def _parse_synthetic(text: str) -> Tuple[int, int]:
    try:
        a, b = text.lower().split("x")
        ranks, steps = int(a), int(b)
        if ranks < 1 or steps < 1:
            raise ValueError
        return ranks, steps
    except ValueError:
        raise UsageError(f"--synthetic '{text}' is not RANKSxSTEPS", "e.g. --synthetic 1024x20") from None


def _parse_straggler(text: str) -> Straggler:
    parts = text.split(":")
    try:
        if not 1 <= len(parts) <= 3:
            raise ValueError
        return Straggler(
            int(parts[0]),
            float(parts[1]) if len(parts) > 1 else 1.5,
            int(parts[2]) if len(parts) > 2 else 0,
        )
    except ValueError:
        raise UsageError(f"--straggler '{text}' is not RANK[:FACTOR[:FROM_STEP]]", "e.g. 17:1.3:5") from None


@click.command("replay")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True), required=False)
@click.option("--redis", "redis_url", required=True, metavar="URL", help="Where to publish (as for probe).")
@click.option("--job", default=None, help="Publish under this job id instead of the recorded one.")
@click.option("--rate", type=float, default=0.0, help="At most this many summaries per second (0: no limit).")
@click.option("--synthetic", metavar="RANKSxSTEPS", default=None, help="Generate summaries, not from FILE.")
@click.option(
    "--straggler", metavar="RANK[:FACTOR[:FROM]]", default=None, help="With --synthetic: one slow rank."
)
@click.option("--seed", type=int, default=0, show_default=True, help="With --synthetic: random seed.")
@click.option(
    "--maxlen", type=int, default=STEPS_MAXLEN, show_default=True, help="XADD MAXLEN ~ of the stream."
)
def replay_cmd(
    file: Optional[str],
    redis_url: str,
    job: Optional[str],
    rate: float,
    synthetic: Optional[str],
    straggler: Optional[str],
    seed: int,
    maxlen: int,
) -> int:
    """Publish recorded or synthetic per-rank step summaries to Redis, as `argus probe --redis`
    would (no BPF, no root): to test or benchmark the aggregator, or to look at a recording again.

    FILE is JSONL from `argus probe --json` ("-" for stdin). Credentials as for probe:
    ARGUS_REDIS_USERNAME, ARGUS_REDIS_PASSWORD or ARGUS_REDIS_PASSWORD_FILE.

    \b
    Examples:
      argus replay steps.jsonl --redis redis://127.0.0.1:6379/0
      argus replay steps.jsonl --redis redis://127.0.0.1:6379/0 --job test-1 --rate 500
      argus replay --synthetic 1024x20 --straggler 17:1.3:5 --job big --redis redis://127.0.0.1:6379/0
    """
    if (file is None) == (synthetic is None):
        raise UsageError(
            "give either FILE or --synthetic RANKSxSTEPS", "e.g. argus replay steps.jsonl --redis URL"
        )
    if straggler and not synthetic:
        raise UsageError("--straggler needs --synthetic", "e.g. --synthetic 64x20 --straggler 3:1.5")
    if rate < 0 or maxlen < 1:
        raise UsageError("--rate must be >= 0 and --maxlen >= 1", "e.g. --rate 1000")
    conf = redisconf.parse(redis_url)
    client = conf.client(timeout_s=10.0)
    if synthetic:
        ranks, n = _parse_synthetic(synthetic)
        st = _parse_straggler(straggler) if straggler else None
        if st is not None and not 0 <= st.rank < ranks:
            raise UsageError(f"--straggler rank {st.rank} is not in 0..{ranks - 1}", "pick an existing rank")
        steps: Iterable[RankStep] = synthetic_steps(job or "synthetic", ranks, n, seed=seed, straggler=st)
        stats = publish_all(client, steps, rate=rate, maxlen=maxlen)
    else:
        assert file is not None
        try:
            f: IO[str] = sys.stdin if file == "-" else open(file, encoding="utf-8")
        except OSError as e:
            raise UsageError(
                f"cannot read {file}: {e.strerror}", "give a JSONL file from argus probe --json"
            ) from None
        with f:
            stats = publish_all(client, load_jsonl(f, file), job=job, rate=rate, maxlen=maxlen)
    med = sorted(stats.sizes)[len(stats.sizes) // 2] if stats.sizes else 0
    click.echo(
        f"replayed {stats.entries} summaries ({stats.bytes} bytes, median {med} B each) to {conf.display} "
        f"in {stats.seconds:.1f} s ({stats.entries / max(stats.seconds, 1e-9):.0f}/s)",
        err=True,
    )
    return 0
