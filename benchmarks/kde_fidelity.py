"""Fidelity / size benchmark: KDE-valley clusters vs a log2 histogram for duration groups.

Run: ``/usr/bin/python3 benchmarks/kde_fidelity.py`` (no PYTHONPATH needed, no numpy).

For synthetic duration workloads with 1, 2 and 3 log-normal modes and n = 200 / 2,000 / 20,000 samples
it compares what the aggregator would see for one group:

* ``kde``:  ``compress`` → ``quantize`` → wire → ``dequantize`` → log-normal mixture;
* ``hist``: ``log2_hist`` (bucket = floor(log2 ns)) → wire → ``hist_quantile`` (geometric in-bucket).

Columns: encoded msgpack bytes (exact size computed by hand when the ``msgpack`` module is missing),
relative error of p50 / p99 / mean against the raw samples, W1 between the reconstruction and the raw
empirical distribution divided by the raw mean (both quantile functions on the same 1,000-point midpoint
grid), and the time to build the summary from the raw samples.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from functools import partial
from typing import Callable, Dict, List, Sequence, Tuple, TypeVar, Union

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kde import (
    compress,
    dequantize,
    empirical_quantile,
    hist_mean,
    hist_quantile,
    log2_hist,
    mixture_mean,
    mixture_quantile,
    quantile_fn_w1,
    quantize,
    to_mixture,
)

try:
    import msgpack  # type: ignore[import-not-found]
except ImportError:  # python3-msgpack is not installed for every interpreter
    msgpack = None

US = 1_000.0
MS = 1_000_000.0
W1_POINTS = 1000
SIZES = (200, 2_000, 20_000)

# field name -> mixture components (weight, median ns, sigma of ln ns)
WORKLOADS: Dict[str, List[Tuple[float, float, float]]] = {
    "gemm kernel durations (1 mode)": [(1.0, 180 * US, 0.08)],
    "all-reduce durations (2 modes)": [(0.8, 400 * US, 0.15), (0.2, 8 * MS, 0.3)],
    "mixed kernel class (3 modes)": [(0.4, 20 * US, 0.3), (0.4, 400 * US, 0.3), (0.2, 8 * MS, 0.3)],
}


def samples(comps: Sequence[Tuple[float, float, float]], n: int, seed: int) -> List[float]:
    rng = random.Random(seed)
    weights = [w for w, _, _ in comps]
    out = []
    for _ in range(n):
        _, med, s = rng.choices(comps, weights)[0]
        out.append(rng.lognormvariate(math.log(med), s))
    return out


def _uint_size(v: int) -> int:
    if v < 0:
        raise ValueError("only non-negative ints are sized")
    return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 2**32 else 9


def msgpack_size(obj: Union[List[int], Dict[int, int]]) -> int:
    """Bytes of ``msgpack.packb(obj)`` for a list of / dict between non-negative ints."""
    if msgpack is not None:
        return len(msgpack.packb(obj))
    n = len(obj)
    header = 1 if n < 16 else 3 if n < 65536 else 5
    if isinstance(obj, dict):
        return header + sum(_uint_size(k) + _uint_size(v) for k, v in obj.items())
    return header + sum(_uint_size(v) for v in obj)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


T = TypeVar("T")


def timed(fn: Callable[[], T], repeat: int = 3) -> Tuple[T, float]:
    """Result of ``fn()`` and its best wall time over ``repeat`` runs (s)."""
    out = fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main() -> None:
    how = "msgpack.packb" if msgpack is not None else "exact msgpack size, computed by hand (no msgpack)"
    print(f"encoded bytes: {how}; errors vs the raw samples; W1 on {W1_POINTS} midpoint quantiles")
    head = (
        f"{'field':32} {'n':>6} {'repr':5} {'bytes':>5} {'k':>3} {'p50 err':>8} {'p99 err':>8} "
        f"{'mean err':>8} {'W1/mean':>8} {'time ms':>8}"
    )
    print(head)
    print("-" * len(head))
    summary: Dict[str, Dict[str, List[Tuple[float, float, float]]]] = {}
    for seed, (field, comps) in enumerate(WORKLOADS.items()):
        summary[field] = {"kde": [], "hist": []}
        for n in SIZES:
            xs = samples(comps, n, 1000 * seed + n)
            raw = sorted(xs)
            raw_mean = math.fsum(raw) / n
            raw_p50, raw_p99 = empirical_quantile(raw, 0.5), empirical_quantile(raw, 0.99)

            raw_q = partial(empirical_quantile, raw)

            clusters, t_kde = timed(partial(compress, xs))
            wire = quantize(clusters)
            mix = to_mixture(dequantize(wire))
            hist, t_hist = timed(partial(log2_hist, xs))

            rows = {
                "kde": (
                    msgpack_size(wire),
                    len(wire) // 3,
                    mixture_quantile(mix, 0.5),
                    mixture_quantile(mix, 0.99),
                    mixture_mean(mix),
                    quantile_fn_w1(partial(mixture_quantile, mix), raw_q, points=W1_POINTS),
                    t_kde,
                ),
                "hist": (
                    msgpack_size(hist),
                    len(hist),
                    hist_quantile(hist, 0.5),
                    hist_quantile(hist, 0.99),
                    hist_mean(hist),
                    quantile_fn_w1(partial(hist_quantile, hist), raw_q, points=W1_POINTS),
                    t_hist,
                ),
            }
            for name, (nbytes, k, p50, p99, mean, w1, t) in rows.items():
                e50, e99, emean = rel(p50, raw_p50), rel(p99, raw_p99), rel(mean, raw_mean)
                w1r = w1 / raw_mean
                summary[field][name].append((nbytes, e99, w1r))
                print(
                    f"{field:32} {n:>6} {name:5} {nbytes:>5} {k:>3} {e50:>8.2%} {e99:>8.2%} "
                    f"{emean:>8.2%} {w1r:>8.2%} {t * 1e3:>8.2f}"
                )
    print()
    for field, reps in summary.items():
        (kb, k99, kw), (hb, h99, hw) = (
            tuple(sum(v) / len(v) for v in zip(*reps[name])) for name in ("kde", "hist")
        )
        verdict = "beat" if (k99 <= h99 and kw <= hw) else "do not beat"
        print(
            f"{field.split(' (')[0]}: KDE clusters ({kb:.0f} bytes, p99 err {k99:.1%}, W1 {kw:.1%} of mean) "
            f"{verdict} log2 hist ({hb:.0f} bytes, p99 err {h99:.1%}, W1 {hw:.1%} of mean)"
            f"  [averages over n = {', '.join(map(str, SIZES))}]"
        )


if __name__ == "__main__":
    main()
