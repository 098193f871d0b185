"""KDE-valley compression of duration samples and log-normal-mixture comparison (ARGUS §5.2).

The agent groups kernel / collective durations per (op class, stream, rank, window) and ships each
group as a handful of numbers instead of raw samples:

1. Take the log of every duration (non-positive and NaN samples clamp to 1 ns, huge ones to ≈ 1.84e19 ns).
2. Estimate the density of the log values with a Gaussian KDE using Scott's bandwidth
   ``h = 1.06 · σ · n^(-1/5)`` (σ: sample standard deviation of the log values), on a regular grid
   spanning ``[min, max]`` of the log values.
3. Local minima ("valleys") of the density are candidate cuts.  A valley only counts if it is
   statistically real: the unnormalised KDE value is an effective local sample count, so with ``P`` the
   smaller of the highest densities left and right of the valley and ``V`` the valley density we require
   ``P − V ≥ min_dip_z · sqrt(P + V)`` (Poisson noise).  This guard is not in the paper; without it a
   Scott bandwidth on 10⁴+ samples turns the sparse tails of a unimodal group into 3–7-sample "modes".
4. Valid valleys are tried deepest first (smallest ``V/P``) and a cut is kept only if, together with the
   cuts already kept, every resulting cluster has at least ``min_side`` samples, adjacent cuts are at
   least ``min_log_gap`` apart and adjacent cluster centres (ln p50) are at least ``min_log_gap`` apart;
   at most ``max_clusters − 1`` cuts are kept.
5. Refinements (also not in the paper, both aimed at Scott's rule over-smoothing multimodal data, whose
   σ is dominated by the distance between the modes): every cluster produced by a cut is searched
   again with its own Scott bandwidth (breadth first), and a segment in which Scott's ``h`` finds no
   valid valley is retried once with ``h/2`` and the stricter threshold ``1.5 · min_dip_z``.  Without
   this, three modes 20× apart in 50 samples come out as one cluster.
6. Every cluster is summarised as :class:`Cluster` ``(count, p50, p99)``, sorted by p50.

Percentiles everywhere in this module (cluster p50/p99, :func:`empirical_quantile`) use **linear
interpolation between closest ranks** on the sorted samples (numpy's default ``"linear"`` / Hyndman-Fan
type 7): position ``q·(m−1)`` in the 0-based sorted list.

The aggregator reconstructs a group as a log-normal mixture (:func:`to_mixture`): one component per
cluster with ``μ = ln p50``, ``σ = (ln p99 − ln p50) / 2.326`` and weight ``count``, and compares ranks
with :func:`wasserstein1`.

For speed with large groups the KDE is evaluated from a histogram of the log values on ``2·grid − 1``
fine nodes (nearest-node binning, kernel precomputed per node offset, truncated at 6h), which costs
``O(n log n)`` for the sort plus ``O(grid²)`` for the convolution, independent of ``n``.  Groups with at
most 64 samples use the exact ``O(n·grid)`` KDE.

Wire format (:func:`quantize`): three unsigned ints per cluster, ``count``, ``q50 = round(1024·log2 p50)``
and ``dq = round(1024·log2 p99) − q50``: log2 fixed point with 10 fractional bits, so both fit a u16 for
durations below 2**64 ns and the relative error of a decoded p50 or p99 is at most
``2**(1/2048) − 1 ≈ 0.0339 %`` (:data:`QUANT_REL_ERROR`).  Storing p99 as a delta makes it a 1-byte
msgpack int whenever p99/p50 < 1.089 and a 2-byte one up to p99/p50 < 1.188, typical of tight kernels.

No numpy: the agent must stay light; only :mod:`math`, :mod:`bisect` and :mod:`statistics` are used.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_right
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Dict, List, Sequence, Tuple

__all__ = [
    "QUANT_FRAC_BITS",
    "QUANT_REL_ERROR",
    "Z99",
    "Cluster",
    "Mixture",
    "compress",
    "dequantize",
    "empirical_quantile",
    "hist_mean",
    "hist_quantile",
    "log2_hist",
    "mixture_cdf",
    "mixture_mean",
    "mixture_quantile",
    "mixture_quantiles",
    "quantile_fn_w1",
    "quantile_grid",
    "quantize",
    "scott_bandwidth",
    "to_mixture",
    "wasserstein1",
    "wasserstein1_quantiles",
]

#: Standard-normal quantile at 0.99 (rounded as in the paper): ``ln p99 − ln p50 = Z99 · σ``.
Z99 = 2.326
#: Fractional bits of the log2 fixed-point encoding used by :func:`quantize`.
QUANT_FRAC_BITS = 10
_QSCALE = 1 << QUANT_FRAC_BITS
#: Upper bound of the relative error of a p50/p99 after :func:`quantize` → :func:`dequantize`.
QUANT_REL_ERROR = 2.0 ** (1.0 / (2 * _QSCALE)) - 1.0

_MIN_NS = 1.0
_MAX_NS = 2.0 ** (65535 / 1024)  # ≈ 1.84e19 ns (584 years): keeps round(1024·log2(x)) ≤ 65535
_EXACT_MAX_N = 64  # groups this small use the exact O(n·grid) KDE
_RETRY_BW = 0.5  # bandwidth factor of the retry when Scott's h finds no significant valley
_RETRY_Z = 1.5  # ... and the stricter dip threshold for it (narrower kernels: more, noisier dips)
_KERNEL_CUTOFF = 6.0  # Gaussian kernel truncated at 6 bandwidths (exp(-18) ≈ 1.5e-8)
_STD_NORMAL = NormalDist()
_SQRT2 = math.sqrt(2.0)
_SQRT_2PI = math.sqrt(2.0 * math.pi)

#: (weight, mu, sigma) per component; weight is the cluster count, mu/sigma are of ln(ns).
Mixture = List[Tuple[float, float, float]]


@dataclass(frozen=True)
class Cluster:
    """One mode of a duration group: sample count and its p50 / p99 in the input unit (ns)."""

    count: int
    p50: float
    p99: float


# --------------------------------------------------------------------------------------------------
# compression


def _clamp(s: float) -> float:
    """Clamp one sample into ``[1, ~2**64]`` ns; NaN and non-positive values become 1 ns."""
    if not s >= _MIN_NS:  # also catches NaN
        return _MIN_NS
    return s if s < _MAX_NS else _MAX_NS


def _pct_sorted(xs: Sequence[float], lo: int, hi: int, q: float) -> float:
    """Linear-interpolation percentile of the sorted slice ``xs[lo:hi]`` (non-empty)."""
    pos = q * (hi - lo - 1)
    i = int(pos)
    frac = pos - i
    a = xs[lo + i]
    if frac == 0.0 or lo + i + 1 >= hi:
        return a
    return a + (xs[lo + i + 1] - a) * frac


def empirical_quantile(samples: Sequence[float], q: float) -> float:
    """Percentile of raw samples with the module's convention (linear interpolation, type 7).

    ``samples`` need not be sorted.  Raises :class:`ValueError` on empty input or ``q`` outside [0, 1].
    """
    if not samples:
        raise ValueError("empirical_quantile of an empty sample")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    xs = sorted(samples)
    return _pct_sorted(xs, 0, len(xs), q)


def scott_bandwidth(log_values: Sequence[float]) -> float:
    """Scott's rule-of-thumb bandwidth ``1.06 · σ · n^(-1/5)`` (σ with ``n − 1`` in the denominator)."""
    n = len(log_values)
    if n < 2:
        return 0.0
    mean = math.fsum(log_values) / n
    var = math.fsum((x - mean) * (x - mean) for x in log_values) / (n - 1)
    return 1.06 * math.sqrt(var) * n ** (-0.2)


def _cluster(ds: Sequence[float], lo: int, hi: int) -> Cluster:
    return Cluster(hi - lo, _pct_sorted(ds, lo, hi, 0.50), _pct_sorted(ds, lo, hi, 0.99))


def _density(logs: Sequence[float], h: float, grid: int) -> Tuple[List[float], List[float]]:
    """Unnormalised KDE of sorted ``logs`` on ``grid`` points spanning ``[logs[0], logs[-1]]``.

    Returns ``(positions, density)``.  Exact for small ``n``; otherwise binned on ``2·grid − 1`` fine nodes.
    """
    lo, hi = logs[0], logs[-1]
    step = (hi - lo) / (grid - 1)
    pos = [lo + j * step for j in range(grid)]
    n = len(logs)
    cut = _KERNEL_CUTOFF * h
    inv2h2 = -0.5 / (h * h)
    if n <= _EXACT_MAX_N:
        exp = math.exp
        dens = []
        for g in pos:
            a = bisect_right(logs, g - cut)
            b = bisect_right(logs, g + cut)
            dens.append(sum(exp((g - x) * (g - x) * inv2h2) for x in logs[a:b]))
        return pos, dens

    nodes = 2 * grid - 1
    d = (hi - lo) / (nodes - 1)
    # nearest-node binning via bisection on the sorted logs: node k collects (lo+(k-½)d, lo+(k+½)d]
    counts = [0.0] * nodes
    prev = 0
    for k in range(nodes - 1):
        idx = bisect_right(logs, lo + (k + 0.5) * d)
        counts[k] = float(idx - prev)
        prev = idx
    counts[nodes - 1] = float(n - prev)

    w = min(nodes - 1, math.ceil(cut / d))
    half = [math.exp((m * d) * (m * d) * inv2h2) for m in range(w + 1)]
    kern = half[:0:-1] + half  # kern[m + w] = K(m·d), m in [-w, w]
    mul = operator.mul
    dens = []
    for j in range(grid):
        i = 2 * j
        a = max(0, i - w)
        b = min(nodes, i + w + 1)
        dens.append(sum(map(mul, counts[a:b], kern[a - i + w : b - i + w])))
    return pos, dens


def _valleys(pos: Sequence[float], dens: Sequence[float], min_dip_z: float) -> List[Tuple[float, float]]:
    """Significant interior local minima of ``dens`` as ``(depth_ratio, log_position)``.

    Plateaus (e.g. an empty gap where the truncated kernels sum to 0) are cut at their middle.
    ``depth_ratio`` = valley density ``V`` / ``P``, with ``P`` the smaller of the highest density left and
    right of the valley; 0 is an empty gap.  The unnormalised KDE value is an effective local sample count,
    so a dip is kept only if ``P − V ≥ min_dip_z · sqrt(P + V)`` (Poisson noise of the two counts): this
    drops the few-sample bumps that a small bandwidth produces in the sparse tails of a unimodal group.
    """
    g = len(dens)
    pre = [0.0] * g
    suf = [0.0] * g
    m = 0.0
    for j in range(g):
        m = max(m, dens[j])
        pre[j] = m
    m = 0.0
    for j in range(g - 1, -1, -1):
        m = max(m, dens[j])
        suf[j] = m
    out: List[Tuple[float, float]] = []
    j = 1
    while j < g - 1:
        if dens[j] < dens[j - 1]:
            e = j
            while e + 1 < g and dens[e + 1] == dens[j]:
                e += 1
            if e + 1 < g and dens[e + 1] > dens[j]:
                peak, v = min(pre[j], suf[e]), dens[j]
                if peak > 0.0 and peak - v >= min_dip_z * math.sqrt(peak + v):
                    out.append((v / peak, 0.5 * (pos[j] + pos[e])))
            j = e + 1
        else:
            j += 1
    return out


def compress(
    samples: Sequence[float],
    *,
    min_side: int = 3,
    min_log_gap: float = 0.15,
    grid: int = 256,
    max_clusters: int = 8,
    min_dip_z: float = 1.5,
) -> List[Cluster]:
    """Compress duration samples (ns) into at most ``max_clusters`` clusters, sorted by p50.

    See the module docstring for the algorithm.  ``min_side``: minimum samples on each side of a cut
    (i.e. per cluster); ``min_log_gap``: minimum natural-log distance between adjacent cuts and between
    adjacent cluster centres (0.15 ≈ 16 %); ``grid``: KDE evaluation points; ``min_dip_z``: how many
    Poisson standard deviations a valley must be below the lower of its two sides (see
    :func:`_valleys`).  Empty input gives ``[]``; fewer than ``2·min_side`` samples or zero spread of the
    log values gives one cluster.  The counts always sum to ``len(samples)``.
    """
    if min_side < 1:
        raise ValueError("min_side must be >= 1")
    if grid < 3:
        raise ValueError("grid must be >= 3")
    if max_clusters < 1:
        raise ValueError("max_clusters must be >= 1")
    if not min_log_gap >= 0.0:
        raise ValueError("min_log_gap must be >= 0")
    if not min_dip_z >= 0.0:
        raise ValueError("min_dip_z must be >= 0")
    n = len(samples)
    if n == 0:
        return []
    ds = sorted(map(_clamp, samples))
    if n < 2 * min_side or max_clusters == 1 or ds[0] == ds[-1]:
        return [_cluster(ds, 0, n)]
    logs = list(map(math.log, ds))

    cuts: List[float] = []  # accepted cut positions (ln ns), sorted
    splits: List[int] = []  # matching split indices into ds/logs: the left cluster ends before idx
    todo = [(0, n)]  # segments [a, b) still to be searched for valleys, breadth first
    while todo and len(cuts) < max_clusters - 1:
        a, b = todo.pop(0)
        if b - a < 2 * min_side or logs[a] == logs[b - 1]:
            continue
        seg = logs[a:b]
        h = scott_bandwidth(seg)
        if not h > 0.0:
            continue
        pos, dens = _density(seg, h, grid)
        valleys = _valleys(pos, dens, min_dip_z)
        if not valleys:  # Scott's h over-smooths well-separated modes of a multimodal segment
            pos, dens = _density(seg, _RETRY_BW * h, grid)
            valleys = _valleys(pos, dens, _RETRY_Z * min_dip_z)
        for _ratio, c in sorted(valleys):  # deepest valley first
            if len(cuts) >= max_clusters - 1:
                break
            k = bisect_right(cuts, c)
            if (k > 0 and c - cuts[k - 1] < min_log_gap) or (k < len(cuts) and cuts[k] - c < min_log_gap):
                continue
            idx = bisect_right(logs, c, a, b)
            bounds = [0, *splits[:k], idx, *splits[k:], n]
            if any(y - x < min_side for x, y in zip(bounds, bounds[1:])):
                continue
            centres = [
                logs[x] if y - x == 1 else math.log(_pct_sorted(ds, x, y, 0.5))
                for x, y in zip(bounds, bounds[1:])
            ]
            if any(y - x < min_log_gap for x, y in zip(centres, centres[1:])):
                continue
            cuts.insert(k, c)
            splits.insert(k, idx)
        # re-examine every piece of this segment with its own (smaller) bandwidth
        inner = [a, *(s for s in splits if a < s < b), b]
        if len(inner) > 2:
            todo.extend(zip(inner, inner[1:]))

    bounds = [0, *splits, n]
    return [_cluster(ds, x, y) for x, y in zip(bounds, bounds[1:])]


# --------------------------------------------------------------------------------------------------
# log-normal mixture reconstruction


def to_mixture(clusters: Sequence[Cluster]) -> Mixture:
    """Log-normal mixture ``[(weight, mu, sigma)]`` with ``mu = ln p50``, ``sigma = (ln p99 − ln p50)/Z99``.

    ``weight`` is the raw cluster count (the functions below normalise).  Empty clusters are dropped; a
    cluster with ``p99 == p50`` becomes a point mass (``sigma == 0``).
    """
    mix: Mixture = []
    for c in clusters:
        if c.count <= 0:
            continue
        mu = math.log(_clamp(c.p50))
        sigma = max(0.0, math.log(_clamp(c.p99)) - mu) / Z99
        mix.append((float(c.count), mu, sigma))
    return mix


def _check_mix(mix: Mixture) -> float:
    total = math.fsum(w for w, _, _ in mix)
    if not mix or not total > 0.0:
        raise ValueError("empty mixture")
    return total


def _cdf_log(mix: Mixture, total: float, y: float) -> float:
    """Mixture CDF at ``ln x == y``."""
    acc = 0.0
    for w, mu, s in mix:
        if s > 0.0:
            acc += w * 0.5 * math.erfc((mu - y) / (s * _SQRT2))
        elif y >= mu:
            acc += w
    return acc / total


def _pdf_log(mix: Mixture, total: float, y: float) -> float:
    """Density of ``ln x`` at ``y`` (point masses contribute nothing)."""
    acc = 0.0
    for w, mu, s in mix:
        if s > 0.0:
            z = (y - mu) / s
            acc += w * math.exp(-0.5 * z * z) / (s * _SQRT_2PI)
    return acc / total


def mixture_cdf(mix: Mixture, x: float) -> float:
    """P(X ≤ x) for the mixture (``x`` in ns); 0 for ``x ≤ 0``."""
    total = _check_mix(mix)
    if not x > 0.0:
        return 0.0
    return _cdf_log(mix, total, math.log(x))


def mixture_mean(mix: Mixture) -> float:
    """Mean of the mixture in ns: ``Σ w·exp(μ + σ²/2) / Σ w``."""
    total = _check_mix(mix)
    return math.fsum(w * math.exp(mu + 0.5 * s * s) for w, mu, s in mix) / total


def mixture_quantiles(mix: Mixture, qs: Sequence[float]) -> List[float]:
    """Quantiles (ns) of the mixture at each ``q`` in ``qs`` (any order, each in [0, 1]).

    Solved in log space by safeguarded Newton (bisection fallback) to 1e-10 in ``ln x``.  The search is
    bracketed by ``[min(μ − 12σ), max(μ + 12σ)]``, so ``q = 0`` / ``q = 1`` return those finite bounds.
    """
    total = _check_mix(mix)
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
    if len(mix) == 1 and mix[0][2] > 0.0:
        _, mu, s = mix[0]
        lo_b, hi_b = mu - 12.0 * s, mu + 12.0 * s
        out1 = []
        for q in qs:
            if q <= 0.0 or q >= 1.0:
                out1.append(math.exp(lo_b if q <= 0.0 else hi_b))
            else:
                out1.append(math.exp(min(hi_b, max(lo_b, mu + s * _STD_NORMAL.inv_cdf(q)))))
        return out1

    lo_b = min(mu - 12.0 * s for _, mu, s in mix)
    hi_b = max(mu + 12.0 * s for _, mu, s in mix)
    solved: Dict[float, float] = {}
    start = lo_b
    for q in sorted(set(qs)):  # ascending, so each solve starts from the previous root
        if q <= 0.0:
            solved[q] = math.exp(lo_b)
            continue
        a, b = start, hi_b  # invariant: F(a) < q <= F(b) (up to the bracket ends)
        if _cdf_log(mix, total, a) >= q:
            solved[q] = math.exp(a)
            continue
        y = 0.5 * (a + b)
        for _ in range(200):
            f = _cdf_log(mix, total, y) - q
            if f < 0.0:
                a = y
            else:
                b = y
            if b - a < 1e-10:
                break
            p = _pdf_log(mix, total, y)
            ny = y - f / p if p > 0.0 else a - 1.0
            if not a < ny < b:
                ny = 0.5 * (a + b)
            if abs(ny - y) < 1e-12:
                break
            y = ny
        y = b if b - a < 1e-10 else y
        solved[q] = math.exp(y)
        start = a
    return [solved[q] for q in qs]


def mixture_quantile(mix: Mixture, q: float) -> float:
    """Quantile (ns) of the mixture at ``q`` in [0, 1] (see :func:`mixture_quantiles`)."""
    return mixture_quantiles(mix, [q])[0]


# --------------------------------------------------------------------------------------------------
# Wasserstein-1


def quantile_grid(clusters: Sequence[Cluster], points: int = 200) -> List[float]:
    """Mixture quantiles (ns) at the midpoints ``(k + ½)/points``, k = 0 … points−1.

    This is the per-rank vector :func:`wasserstein1` integrates; the aggregator can compute it once per
    rank and group and compare many pairs with :func:`wasserstein1_quantiles`.
    """
    if points < 1:
        raise ValueError("points must be >= 1")
    return mixture_quantiles(to_mixture(clusters), [(k + 0.5) / points for k in range(points)])


def wasserstein1_quantiles(qa: Sequence[float], qb: Sequence[float], *, log_space: bool = False) -> float:
    """W1 from two equal-length midpoint quantile grids (see :func:`quantile_grid`)."""
    if len(qa) != len(qb) or not qa:
        raise ValueError("quantile grids must be non-empty and of equal length")
    if log_space:
        return math.fsum(abs(math.log(x) - math.log(y)) for x, y in zip(qa, qb)) / len(qa)
    return math.fsum(abs(x - y) for x, y in zip(qa, qb)) / len(qa)


def wasserstein1(
    a: Sequence[Cluster], b: Sequence[Cluster], *, points: int = 200, log_space: bool = False
) -> float:
    """Wasserstein-1 distance between the log-normal mixtures reconstructed from ``a`` and ``b``.

    ``W1 = ∫₀¹ |F_a⁻¹(q) − F_b⁻¹(q)| dq``, evaluated with the midpoint rule on ``points`` quantiles
    ``q = (k + ½)/points``.  The midpoint rule never evaluates q = 0 or 1, where log-normal quantiles are
    0 / ∞; it therefore ignores the outer ``1/(2·points)`` of each tail (0.25 % at 200 points), which is
    where the log-normal fit (from p50/p99 only) is least trustworthy anyway.

    ``log_space=False`` (default): in ns, so the result has the unit of the durations and a uniform
    slowdown by factor ``k`` of a distribution with mean ``m`` gives ``(k − 1)·m``.  ``log_space=True``:
    integrates ``|ln F_a⁻¹ − ln F_b⁻¹|``, a unitless, scale-free distance (a ``k``× slowdown gives ``ln k``)
    that weighs fast and slow modes equally.  Raises :class:`ValueError` if either side is empty.
    """
    return wasserstein1_quantiles(quantile_grid(a, points), quantile_grid(b, points), log_space=log_space)


# --------------------------------------------------------------------------------------------------
# wire encoding


def quantize(clusters: Sequence[Cluster]) -> List[int]:
    """Flat int list ``[count, q50, dq, count, q50, dq, …]`` for msgpack.

    ``q50 = round(1024·log2 p50)``, ``dq = round(1024·log2 p99) − q50`` (≥ 0), both < 65536 for durations
    below 2**64 ns (values are clamped to [1, 2**(65535/1024)] ns).  Decoded values are within
    :data:`QUANT_REL_ERROR` (≈ 0.034 %) relative of the clamped originals.
    """
    out: List[int] = []
    for c in clusters:
        q50 = round(_QSCALE * math.log2(_clamp(c.p50)))
        q99 = max(q50, round(_QSCALE * math.log2(_clamp(c.p99))))
        out.extend((int(c.count), q50, q99 - q50))
    return out


def dequantize(data: Sequence[int]) -> List[Cluster]:
    """Inverse of :func:`quantize`."""
    if len(data) % 3:
        raise ValueError("quantized cluster list length must be a multiple of 3")
    out = []
    for i in range(0, len(data), 3):
        count, q50, dq = int(data[i]), int(data[i + 1]), int(data[i + 2])
        if count < 0 or dq < 0:
            raise ValueError("negative count or p99 delta in quantized clusters")
        out.append(Cluster(count, 2.0 ** (q50 / _QSCALE), 2.0 ** ((q50 + dq) / _QSCALE)))
    return out


# --------------------------------------------------------------------------------------------------
# log2 histogram baseline


def log2_hist(samples: Sequence[float]) -> Dict[int, int]:
    """Histogram with bucket ``floor(log2(ns))`` (samples clamped to [1, 2**64) ns, so buckets 0 … 63)."""
    h: Dict[int, int] = {}
    frexp = math.frexp
    for s in samples:
        b = frexp(_clamp(s))[1] - 1  # x = m·2**e, m in [0.5, 1)  ⇒  floor(log2 x) = e − 1
        h[b] = h.get(b, 0) + 1
    return h


def hist_quantile(h: Dict[int, int], q: float) -> float:
    """Quantile (ns) of a :func:`log2_hist`, treating each bucket ``[2**b, 2**(b+1))`` as log-uniform.

    The target rank ``q·N`` is located in the cumulative counts and interpolated geometrically inside its
    bucket: ``2**(b + (q·N − below)/count_b)``.  Raises :class:`ValueError` on an empty histogram.
    """
    total = sum(c for c in h.values() if c > 0)
    if total <= 0:
        raise ValueError("hist_quantile of an empty histogram")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    target = q * total
    below = 0
    items = sorted((b, c) for b, c in h.items() if c > 0)
    for b, c in items:
        if below + c >= target:
            return 2.0 ** (b + max(0.0, target - below) / c)
        below += c
    b = items[-1][0]
    return 2.0 ** (b + 1)


def hist_mean(h: Dict[int, int]) -> float:
    """Mean (ns) of a :func:`log2_hist` under the log-uniform-within-bucket model: bucket mean 2**b/ln 2."""
    total = sum(c for c in h.values() if c > 0)
    if total <= 0:
        raise ValueError("hist_mean of an empty histogram")
    return math.fsum(c * 2.0**b / math.log(2.0) for b, c in h.items() if c > 0) / total


def quantile_fn_w1(
    fa: Callable[[float], float], fb: Callable[[float], float], *, points: int = 200, log_space: bool = False
) -> float:
    """W1 between two arbitrary quantile functions with the same midpoint rule as :func:`wasserstein1`."""
    qs = [(k + 0.5) / points for k in range(points)]
    return wasserstein1_quantiles([fa(q) for q in qs], [fb(q) for q in qs], log_space=log_space)
