"""Unit tests for benchmarks/kde.py (the paper's KDE compression, kept for the size and fidelity
benchmarks): KDE-valley compression, log-normal mixtures, W1, wire encoding, log2 hist."""

from __future__ import annotations

import math
import random
import time
from typing import List, Sequence, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.kde import (
    QUANT_REL_ERROR,
    Z99,
    Cluster,
    compress,
    dequantize,
    empirical_quantile,
    hist_mean,
    hist_quantile,
    log2_hist,
    mixture_cdf,
    mixture_mean,
    mixture_quantile,
    mixture_quantiles,
    quantile_fn_w1,
    quantile_grid,
    quantize,
    scott_bandwidth,
    to_mixture,
    wasserstein1,
    wasserstein1_quantiles,
)

US = 1_000.0
MS = 1_000_000.0
# (weight, median ns, sigma of ln ns): p99/p50 = exp(2.326·0.3) ≈ 2.0, modes 20× apart
ONE = [(1.0, 20 * US, 0.3)]
TWO = [(0.7, 20 * US, 0.3), (0.3, 400 * US, 0.3)]
TWO_RARE = [(0.95, 400 * US, 0.3), (0.05, 8 * MS, 0.3)]
THREE = [(0.5, 20 * US, 0.3), (0.3, 400 * US, 0.3), (0.2, 8 * MS, 0.3)]
THREE_SKEWED = [(0.2, 20 * US, 0.25), (0.7, 400 * US, 0.4), (0.1, 8 * MS, 0.2)]

Components = Sequence[Tuple[float, float, float]]


def mixture_samples(comps: Components, n: int, seed: int) -> Tuple[List[float], List[List[float]]]:
    """Shuffled samples of a log-normal mixture with exact per-component counts, plus the components."""
    rng = random.Random(seed)
    total_w = sum(w for w, _, _ in comps)
    counts = [round(n * w / total_w) for w, _, _ in comps]
    counts[-1] = n - sum(counts[:-1])
    parts = [
        [rng.lognormvariate(math.log(med), s) for _ in range(c)] for c, (_, med, s) in zip(counts, comps)
    ]
    flat = [x for p in parts for x in p]
    rng.shuffle(flat)
    return flat, parts


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# --------------------------------------------------------------------------------------------------
# compress: edge cases


def test_empty() -> None:
    assert compress([]) == []


def test_fewer_than_two_min_sides_is_one_cluster() -> None:
    xs = [10.0, 20.0, 1e6, 2e6, 3e6]  # would split, but 5 < 2·3
    (c,) = compress(xs)
    assert c.count == 5
    assert c.p50 == 1e6
    assert c.p99 == pytest.approx(2e6 + 0.96 * 1e6)  # linear interpolation, position 0.99·4 = 3.96


def test_zero_spread_is_one_cluster() -> None:
    assert compress([5000.0] * 1000) == [Cluster(1000, 5000.0, 5000.0)]


def test_non_positive_and_nan_clamp_to_one_ns() -> None:
    (c,) = compress([-5.0, 0.0, 0.5, float("nan"), 1.0, 1.0])
    assert c == Cluster(6, 1.0, 1.0)


def test_max_clusters_one_and_param_validation() -> None:
    xs, _ = mixture_samples(THREE, 3000, 1)
    (c,) = compress(xs, max_clusters=1)
    assert c.count == 3000
    for bad in ({"min_side": 0}, {"grid": 2}, {"max_clusters": 0}, {"min_log_gap": -1.0}, {"min_dip_z": -1}):
        with pytest.raises(ValueError):
            compress(xs, **bad)  # type: ignore[arg-type]


def test_percentile_convention_is_linear_interpolation() -> None:
    xs = [float(v) for v in range(1, 101)]  # 1..100
    (c,) = compress(xs)
    assert c.p50 == pytest.approx(50.5)
    assert c.p99 == pytest.approx(99.01)
    assert empirical_quantile(xs, 0.5) == pytest.approx(50.5)
    assert empirical_quantile(xs, 0.99) == pytest.approx(99.01)


# --------------------------------------------------------------------------------------------------
# compress: multimodal fidelity

CASES = [
    *[("one", ONE, n, seed) for n in (50, 500, 5_000, 50_000) for seed in (1, 2)],
    *[("two", TWO, n, seed) for n in (50, 200, 2_000, 50_000) for seed in (1, 2)],
    *[("two-rare", TWO_RARE, n, seed) for n in (200, 2_000, 20_000) for seed in (1, 2)],
    *[("three", THREE, n, seed) for n in (50, 200, 2_000, 20_000, 50_000) for seed in (1, 2)],
    *[("three-skewed", THREE_SKEWED, n, seed) for n in (100, 1_000, 10_000) for seed in (1, 2)],
]


@pytest.mark.parametrize(
    ("name", "comps", "n", "seed"), CASES, ids=[f"{c[0]}-n{c[2]}-s{c[3]}" for c in CASES]
)
def test_multimodal_clusters_match_components(name: str, comps: Components, n: int, seed: int) -> None:
    xs, parts = mixture_samples(comps, n, seed)
    clusters = compress(xs)
    assert len(clusters) == len(comps), (name, [c.count for c in clusters])
    assert sum(c.count for c in clusters) == n
    for c, part in zip(clusters, parts):
        assert abs(c.count - len(part)) <= 0.02 * len(part)
        assert rel(c.p50, empirical_quantile(part, 0.50)) < 0.05
        assert rel(c.p99, empirical_quantile(part, 0.99)) < 0.05


@pytest.mark.parametrize("n", [2_000, 20_000])
def test_modes_three_times_apart_are_resolved(n: int) -> None:
    xs, parts = mixture_samples([(0.5, 20 * US, 0.3), (0.5, 60 * US, 0.3)], n, 7)
    clusters = compress(xs)
    assert len(clusters) == 2
    for c, part in zip(clusters, parts):
        assert abs(c.count - len(part)) <= 0.05 * len(part)  # components overlap a little
        assert rel(c.p50, empirical_quantile(part, 0.5)) < 0.05


@pytest.mark.parametrize("sigma", [0.3, 1.0, 1.5])
@pytest.mark.parametrize("n", [50, 500, 5_000, 50_000])
def test_unimodal_wide_does_not_split(sigma: float, n: int) -> None:
    for seed in range(3 if n < 50_000 else 1):
        xs, _ = mixture_samples([(1.0, 50 * US, sigma)], n, 100 + seed)
        clusters = compress(xs)
        assert len(clusters) == 1, (sigma, n, seed, [c.count for c in clusters])
        assert clusters[0].p50 == pytest.approx(empirical_quantile(xs, 0.5))


@pytest.mark.parametrize("n", [200, 5_000])
def test_skewed_unimodal_kernel_shapes_do_not_split(n: int) -> None:
    rng = random.Random(3)
    shifted_exp = [10 * US + rng.expovariate(1 / (3 * US)) for _ in range(n)]  # launch floor + queueing
    gamma = [1 * US + 10 * US * rng.gammavariate(2.0, 1.0) for _ in range(n)]
    assert len(compress(shifted_exp)) == 1
    assert len(compress(gamma)) == 1


def test_max_clusters_caps_and_keeps_deepest_valleys() -> None:
    xs, parts = mixture_samples(THREE, 3_000, 4)
    clusters = compress(xs, max_clusters=2)
    assert len(clusters) == 2
    assert sum(c.count for c in clusters) == 3_000
    assert {c.count for c in clusters} <= {len(parts[0]), len(parts[0]) + len(parts[1]), len(parts[2])} | {
        len(parts[1]) + len(parts[2])
    }


def test_min_side_guard() -> None:
    rng = random.Random(5)
    xs = [rng.lognormvariate(math.log(20 * US), 0.2) for _ in range(100)] + [8 * MS, 8.1 * MS]
    # min_dip_z=0 so that only min_side decides; max_clusters=2 keeps just the deepest (empty-gap) valley
    assert len(compress(xs, min_side=3, min_dip_z=0.0, max_clusters=2)) == 1
    clusters = compress(xs, min_side=2, min_dip_z=0.0, max_clusters=2)
    assert [c.count for c in clusters] == [100, 2]


def test_min_log_gap_guard() -> None:
    rng = random.Random(6)
    # two very tight modes 10 % apart: ln 1.1 ≈ 0.095 < default min_log_gap 0.15
    xs = [rng.lognormvariate(math.log(100 * US), 0.005) for _ in range(1000)]
    xs += [rng.lognormvariate(math.log(110 * US), 0.005) for _ in range(1000)]
    assert len(compress(xs)) == 1
    assert [c.count for c in compress(xs, min_log_gap=0.05)] == [1000, 1000]


def test_compress_100k_is_fast() -> None:
    xs, _ = mixture_samples(THREE, 100_000, 8)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        clusters = compress(xs)
        best = min(best, time.perf_counter() - t0)
    assert len(clusters) == 3
    # ≈ 30 ms on a laptop-class core; the loose bound only catches an accidental O(n·grid) KDE (seconds)
    assert best < 1.0


def test_scott_bandwidth() -> None:
    assert scott_bandwidth([1.0]) == 0.0
    xs = [float(i) for i in range(10)]
    sd = math.sqrt(sum((x - 4.5) ** 2 for x in xs) / 9)
    assert scott_bandwidth(xs) == pytest.approx(1.06 * sd * 10 ** (-0.2))


# --------------------------------------------------------------------------------------------------
# mixture reconstruction

A3 = [Cluster(500, 20 * US, 40 * US), Cluster(300, 400 * US, 800 * US), Cluster(200, 8 * MS, 16 * MS)]


def test_to_mixture_parameters() -> None:
    mix = to_mixture([Cluster(10, 1000.0, 2000.0), Cluster(0, 5.0, 6.0), Cluster(3, 50.0, 50.0)])
    assert len(mix) == 2  # empty cluster dropped
    w, mu, s = mix[0]
    assert (w, mu) == (10.0, math.log(1000.0))
    assert s == pytest.approx(math.log(2.0) / Z99)
    assert mix[1] == (3.0, math.log(50.0), 0.0)


def test_single_component_quantiles_recover_p50_p99() -> None:
    mix = to_mixture([Cluster(7, 30 * US, 90 * US)])
    assert mixture_quantile(mix, 0.5) == pytest.approx(30 * US)
    assert mixture_quantile(mix, 0.99) == pytest.approx(90 * US, rel=3e-4)  # Z99 = 2.326 is rounded
    assert mixture_cdf(mix, 30 * US) == pytest.approx(0.5)
    assert mixture_mean(mix) == pytest.approx(30 * US * math.exp(0.5 * (math.log(3.0) / Z99) ** 2))


def test_mixture_quantile_inverts_cdf() -> None:
    mix = to_mixture(A3)
    qs = [0.001, 0.1, 0.3, 0.5, 0.5, 0.79, 0.81, 0.95, 0.999]
    xs = mixture_quantiles(mix, qs)
    for q, x in zip(qs, xs):
        assert mixture_cdf(mix, x) == pytest.approx(q, abs=1e-9)
    assert xs == sorted(xs)
    assert mixture_quantiles(mix, qs[::-1]) == pytest.approx(xs[::-1])
    assert mixture_cdf(mix, 0.0) == 0.0
    assert mixture_quantile(mix, 0.0) < mixture_quantile(mix, 1e-6) < mixture_quantile(mix, 1.0)
    with pytest.raises(ValueError):
        mixture_quantile(mix, 1.5)
    with pytest.raises(ValueError):
        mixture_mean([])


def test_point_mass_mixture() -> None:
    mix = to_mixture([Cluster(1, 5 * US, 5 * US), Cluster(1, 10 * US, 10 * US)])
    assert mixture_quantile(mix, 0.25) == pytest.approx(5 * US)
    assert mixture_quantile(mix, 0.75) == pytest.approx(10 * US)
    assert mixture_mean(mix) == pytest.approx(7.5 * US)


def test_mixture_mean_matches_sample_mean() -> None:
    xs, _ = mixture_samples(THREE, 20_000, 9)
    mean = sum(xs) / len(xs)
    assert rel(mixture_mean(to_mixture(compress(xs))), mean) < 0.05


# --------------------------------------------------------------------------------------------------
# Wasserstein-1


def scaled(cs: Sequence[Cluster], k: float) -> List[Cluster]:
    return [Cluster(c.count, c.p50 * k, c.p99 * k) for c in cs]


def random_clusters(rng: random.Random) -> List[Cluster]:
    out = []
    for _ in range(rng.randint(1, 4)):
        p50 = math.exp(rng.uniform(math.log(1 * US), math.log(50 * MS)))
        out.append(Cluster(rng.randint(1, 1000), p50, p50 * math.exp(rng.uniform(0.0, 2.0))))
    return out


def test_w1_identical_is_zero() -> None:
    assert wasserstein1(A3, A3) == 0.0
    assert wasserstein1(A3, list(A3), log_space=True) == 0.0
    # same distribution, compressed from two different seeds: small relative to the mean
    a = compress(mixture_samples(THREE, 20_000, 10)[0])
    b = compress(mixture_samples(THREE, 20_000, 11)[0])
    assert wasserstein1(a, b) < 0.03 * mixture_mean(to_mixture(a))


def test_w1_of_uniform_slowdown() -> None:
    for cs in (A3, [Cluster(100, 50 * US, 80 * US)]):
        b = scaled(cs, 1.5)
        mean = mixture_mean(to_mixture(cs))
        # midpoint rule drops the outer 1/400 of each tail, so slightly below (k − 1)·mean
        assert wasserstein1(cs, b) == pytest.approx(0.5 * mean, rel=0.02)
        assert wasserstein1(cs, b, points=2000) == pytest.approx(0.5 * mean, rel=0.005)
        assert wasserstein1(cs, b, log_space=True) == pytest.approx(math.log(1.5), rel=1e-6)


def test_w1_of_samples_slowdown() -> None:
    xs, _ = mixture_samples(TWO, 5_000, 12)
    mean = sum(xs) / len(xs)
    w = wasserstein1(compress(xs), compress([1.5 * x for x in xs]))
    assert w == pytest.approx(0.5 * mean, rel=0.05)


def test_w1_symmetric_and_triangle() -> None:
    rng = random.Random(13)
    for _ in range(40):
        a, b, c = random_clusters(rng), random_clusters(rng), random_clusters(rng)
        for log_space in (False, True):
            ab = wasserstein1(a, b, log_space=log_space)
            ba = wasserstein1(b, a, log_space=log_space)
            assert ab == pytest.approx(ba, rel=1e-12)
            ac = wasserstein1(a, c, log_space=log_space)
            cb = wasserstein1(c, b, log_space=log_space)
            assert ab <= ac + cb + 1e-9 * (ab + ac + cb)
            assert ab >= 0.0


def test_w1_helpers_and_errors() -> None:
    ga, gb = quantile_grid(A3, 50), quantile_grid(scaled(A3, 2.0), 50)
    assert len(ga) == 50
    assert wasserstein1_quantiles(ga, gb) == pytest.approx(wasserstein1(A3, scaled(A3, 2.0), points=50))
    ma, mb = to_mixture(A3), to_mixture(scaled(A3, 2.0))
    assert quantile_fn_w1(
        lambda q: mixture_quantile(ma, q), lambda q: mixture_quantile(mb, q), points=50
    ) == (pytest.approx(wasserstein1_quantiles(ga, gb)))
    with pytest.raises(ValueError):
        wasserstein1([], A3)
    with pytest.raises(ValueError):
        wasserstein1_quantiles([1.0], [1.0, 2.0])


# --------------------------------------------------------------------------------------------------
# wire encoding


def test_quantize_round_trip_error_bound() -> None:
    rng = random.Random(14)
    cs = []
    for _ in range(2000):
        p50 = math.exp(rng.uniform(0.0, math.log(1e15)))
        cs.append(Cluster(rng.randint(0, 10**6), p50, p50 * math.exp(rng.uniform(0.0, 4.0))))
    enc = quantize(cs)
    assert len(enc) == 3 * len(cs)
    assert all(isinstance(v, int) and v >= 0 for v in enc)
    assert all(v <= 0xFFFF for i, v in enumerate(enc) if i % 3)  # q50 and dq fit u16
    dec = dequantize(enc)
    assert QUANT_REL_ERROR < 3.4e-4
    for a, b in zip(cs, dec):
        assert b.count == a.count
        assert rel(b.p50, a.p50) <= QUANT_REL_ERROR * (1 + 1e-9)
        assert rel(b.p99, a.p99) <= QUANT_REL_ERROR * (1 + 1e-9)
        assert b.p50 <= b.p99


def test_quantize_extremes_and_errors() -> None:
    enc = quantize([Cluster(1, 0.0, -3.0), Cluster(2, 1e30, 1e30)])
    assert enc[:3] == [1, 0, 0]  # clamped to 1 ns
    assert max(enc) <= 0xFFFF
    dec = dequantize(enc)
    assert dec[0] == Cluster(1, 1.0, 1.0)
    assert dec[1].p50 == pytest.approx(2.0**64, rel=1e-3)
    assert quantize([]) == [] and dequantize([]) == []
    with pytest.raises(ValueError):
        dequantize([1, 2])
    with pytest.raises(ValueError):
        dequantize([1, 2, -1])


def test_quantized_w1_is_unaffected() -> None:
    a = compress(mixture_samples(THREE, 5_000, 15)[0])
    assert wasserstein1(a, dequantize(quantize(a))) < 1e-3 * mixture_mean(to_mixture(a))


# --------------------------------------------------------------------------------------------------
# log2 histogram


def test_log2_hist_buckets() -> None:
    h = log2_hist([1023.0, 1024.0, 2047.9, 2048.0, 0.0, -1.0, 1.5, float("nan")])
    assert h == {9: 1, 10: 2, 11: 1, 0: 4}
    assert log2_hist([]) == {}


def test_hist_quantile() -> None:
    h = {10: 50, 12: 50}
    assert hist_quantile(h, 0.0) == 1024.0
    assert hist_quantile(h, 0.25) == pytest.approx(2.0**10.5)
    assert hist_quantile(h, 0.5) == pytest.approx(2048.0)
    assert hist_quantile(h, 0.75) == pytest.approx(2.0**12.5)
    assert hist_quantile(h, 1.0) == pytest.approx(8192.0)
    with pytest.raises(ValueError):
        hist_quantile({}, 0.5)
    with pytest.raises(ValueError):
        hist_quantile(h, -0.1)


def test_hist_quantile_and_mean_of_log_uniform_samples() -> None:
    rng = random.Random(16)
    xs = [2.0 ** rng.uniform(10.0, 20.0) for _ in range(50_000)]
    h = log2_hist(xs)
    for q in (0.1, 0.5, 0.9, 0.99):
        assert rel(hist_quantile(h, q), empirical_quantile(xs, q)) < 0.03
    assert rel(hist_mean(h), sum(xs) / len(xs)) < 0.02


# --------------------------------------------------------------------------------------------------
# property tests

durations = st.floats(min_value=-1e3, max_value=1e13, allow_nan=False, allow_infinity=False)


@st.composite
def clustered_samples(draw: st.DrawFn) -> List[float]:
    """A few random modes with random spreads (hits the splitting paths far more often than raw floats)."""
    out: List[float] = []
    for _ in range(draw(st.integers(1, 4))):
        centre = draw(st.floats(0.0, 25.0))
        spread = draw(st.sampled_from([0.0, 1e-6, 0.01, 0.3, 1.0]))
        k = draw(st.integers(1, 80))
        seed = draw(st.integers(0, 2**32))
        rng = random.Random(seed)
        out += [math.exp(centre + spread * rng.gauss(0.0, 1.0)) for _ in range(k)]
    return out


def check_invariants(
    xs: Sequence[float], clusters: Sequence[Cluster], min_side: int, max_clusters: int
) -> None:
    assert sum(c.count for c in clusters) == len(xs)
    assert len(clusters) <= max_clusters
    assert bool(clusters) == bool(xs)
    for c in clusters:
        assert c.count >= 1
        assert 1.0 <= c.p50 <= c.p99
        assert math.isfinite(c.p99)
        if len(clusters) > 1:
            assert c.count >= min_side
    assert [c.p50 for c in clusters] == sorted(c.p50 for c in clusters)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.lists(durations, max_size=300), clustered_samples()),
    st.integers(1, 10),
    st.integers(1, 8),
    st.sampled_from([3, 16, 256]),
    st.sampled_from([0.0, 0.15, 1.0]),
)
def test_property_compress_invariants(
    xs: List[float], min_side: int, max_clusters: int, grid: int, min_log_gap: float
) -> None:
    clusters = compress(xs, min_side=min_side, max_clusters=max_clusters, grid=grid, min_log_gap=min_log_gap)
    check_invariants(xs, clusters, min_side, max_clusters)
    if len(clusters) > 1:
        logs = [math.log(c.p50) for c in clusters]
        assert all(b - a >= min_log_gap - 1e-12 for a, b in zip(logs, logs[1:]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=60))
def test_property_any_floats_never_raise(xs: List[float]) -> None:
    clusters = compress(xs)
    check_invariants(xs, clusters, 3, 8)
    dec = dequantize(quantize(clusters))
    assert [c.count for c in dec] == [c.count for c in clusters]
    if clusters:
        w = wasserstein1(clusters, dec)
        assert math.isfinite(w)
        h = log2_hist(xs)
        assert sum(h.values()) == len(xs)
        assert 1.0 <= hist_quantile(h, 0.5) <= 2.0**64


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e18), st.floats(0.0, 20.0), st.integers(0, 2**31))
def test_property_quantize_bound(p50: float, log_ratio: float, count: int) -> None:
    p99 = min(p50 * math.exp(log_ratio), 1.8e19)
    (c,) = dequantize(quantize([Cluster(count, p50, p99)]))
    assert c.count == count
    assert rel(c.p50, p50) <= QUANT_REL_ERROR * (1 + 1e-9)
    assert rel(c.p99, p99) <= QUANT_REL_ERROR * (1 + 1e-9)
