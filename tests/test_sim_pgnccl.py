"""The simulated job behaves like stock PyTorch (ProcessGroupNCCL) over NCCL: per DP collective the
stream arrival its ground truth records, the network proxy's first send right after it on a
communicator that spans hosts, a straggler's late arrivals, with and without
TORCH_NCCL_ENABLE_TIMING; and the net plugins' isend functions are local symbols, as in NVIDIA's
builds."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

from argus.sim.build import build
from argus.sim.launcher import SimConfig, SimJob
from tests.helpers import run_argus


def run_job(cfg: SimConfig) -> SimJob:
    job = SimJob(cfg)
    try:
        job.start()
        job.wait()
    finally:
        job.stop()
    return job


def check_arrivals(job: SimJob, spans: bool) -> None:
    """Every step line has the DP collectives' arrivals, in order, inside the step; with a
    communicator across hosts, the proxy's first send follows each arrival closely."""
    lags: List[int] = []
    for r, rs in job.ranks.items():
        meta = rs.meta
        assert meta is not None and meta["dp_spans_hosts"] is spans
        offset = meta["realtime_minus_monotonic_ns"]  # step times are monotonic, dp_* realtime
        assert len(rs.records) == job.cfg.steps
        for rec in rs.records:
            arrive = rec["dp_gpu_arrive_ns"]
            assert len(arrive) == len(rec["dp_seqs"]) == meta["buckets_per_step"], (r, rec["step"])
            assert all(a is not None for a in arrive)
            assert arrive == sorted(arrive) and len(set(arrive)) == len(arrive), (r, rec["step"])
            # the stream reaches a bucket after the step began, and before the step's sync returned
            assert rec["start_ns"] + offset - 2_000_000 <= arrive[0], (r, rec["step"])
            assert arrive[-1] <= rec["end_ns"] + offset + 2_000_000, (r, rec["step"])
            if not spans:
                assert "dp_first_send_ns" not in rec
                continue
            first = rec["dp_first_send_ns"]
            assert len(first) == len(arrive) and all(f is not None for f in first), (r, rec["step"])
            for a, f in zip(arrive, first):
                assert f >= a - 200_000, (r, rec["step"], a, f)  # never before the arrival
                lags.append(f - a)
    if spans:
        # at once: the proxy's wake-up, ~0.1 ms typically (a loaded 2-core machine stretches it)
        assert statistics.median(lags) < 2_000_000, sorted(lags)[len(lags) // 2 :][:20]


def step_arrivals(job: SimJob, rank: int) -> Dict[int, List[int]]:
    return {rec["step"]: rec["dp_gpu_arrive_ns"] for rec in job.ranks[rank].records}


def test_pgnccl_timing_two_hosts_straggler(tmp_path: Path) -> None:
    """8 ranks on 2 hosts, TORCH_NCCL_ENABLE_TIMING=1, no Megatron timers, rank 3 a straggler:
    rank 3's stream reaches the DP all-reduces after the others'."""
    job = run_job(
        SimConfig(
            ranks=8,
            steps=5,
            preset="small",
            ranks_per_host=4,
            host_names=["vm-a", "vm-b"],
            timers=False,
            nccl_timing=True,
            injects=["straggler:rank=3,factor=1.3"],
            run_dir=str(tmp_path),
        )
    )
    check_arrivals(job, spans=True)
    for rs in job.ranks.values():
        assert rs.meta is not None and rs.meta["nccl_timing"] is True and rs.meta["timers"] is False
        assert all(rec["timers_ms"] == {} for rec in rs.records)
    # the watchdog read cuEventElapsedTime for the works it retired (a step's, or the previous one's)
    elapsed = [ms for rec in job.ranks[0].records for ms in rec["pg_elapsed_ms"].values()]
    assert len(elapsed) >= 2 * job.ranks[0].meta["buckets_per_step"] and all(ms > 0 for ms in elapsed)
    arr = {r: step_arrivals(job, r) for r in range(8)}
    later = total = 0
    for step in range(1, job.cfg.steps):
        for i in range(len(arr[3][step])):
            others = statistics.median(arr[r][step][i] for r in range(8) if r != 3)
            later += arr[3][step][i] > others
            total += 1
    assert later >= 0.75 * total, (later, total)


def test_pgnccl_default_two_hosts(tmp_path: Path) -> None:
    """The defaults (a stock PyTorch job: no timers, no TORCH_NCCL_ENABLE_TIMING) on 2 hosts: the
    same ground truth, no Megatron timers, no watchdog timings; `timers=True` brings the timers back."""
    job = run_job(SimConfig(ranks=8, steps=4, preset="small", ranks_per_host=4, run_dir=str(tmp_path)))
    check_arrivals(job, spans=True)
    for rs in job.ranks.values():
        assert rs.meta is not None and rs.meta["nccl_timing"] is False and rs.meta["timers"] is False
        for rec in rs.records:
            assert not rec["timers_ms"]
            assert "pg_elapsed_ms" not in rec
            # the watchdog's and the allocator's polls of events not done yet, counted per step
            assert rec["errors"]["cuEventQuery:600"] >= 1
    job = run_job(SimConfig(ranks=2, steps=3, preset="small", timers=True, run_dir=str(tmp_path / "timers")))
    for rs in job.ranks.values():
        assert rs.meta is not None and rs.meta["timers"] is True
        for rec in rs.records:
            assert set(rec["timers_ms"]) == {"forward", "backward", "optimizer", "grad_sync"}


def test_cli_nccl_timing_one_host(tmp_path: Path) -> None:
    """`argus sim run --nccl-timing --no-timers` on one host: the ranks see
    TORCH_NCCL_ENABLE_TIMING=1 in their environment, and nothing goes over the network."""
    res = run_argus(
        "sim",
        "run",
        "--ranks",
        "2",
        "--steps",
        "3",
        "--preset",
        "small",
        "--nccl-timing",
        "--no-timers",
        "-q",
        "--run-dir",
        str(tmp_path),
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    for r in range(2):
        lines = [json.loads(ln) for ln in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
        meta = next(x["meta"] for x in lines if "meta" in x)
        assert meta["nccl_timing"] is True and meta["timers"] is False and meta["dp_spans_hosts"] is False
        steps = [x for x in lines if "step" in x]
        assert len(steps) == 3
        for rec in steps:
            assert rec["timers_ms"] == {} and "dp_first_send_ns" not in rec and "pg_elapsed_ms" in rec
            assert len(rec["dp_gpu_arrive_ns"]) == meta["buckets_per_step"]


@pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("nm") is None, reason="no binutils")
def test_net_isend_functions_are_local_symbols() -> None:
    """ncclNetSocketIsend and ncclIbIsend: LOCAL FUNC in .symtab, absent from .dynsym, the library
    not stripped (as in NVIDIA's wheels, where a tracer finds them through .symtab)."""
    lib = str(build().libnccl)
    symtab = subprocess.run(["readelf", "-sW", lib], capture_output=True, text=True, check=True).stdout
    dynsym = subprocess.run(["readelf", "-W", "--dyn-syms", lib], capture_output=True, text=True, check=True)
    sections = subprocess.run(["readelf", "-SW", lib], capture_output=True, text=True, check=True).stdout
    nm = subprocess.run(["nm", lib], capture_output=True, text=True, check=True).stdout
    assert ".symtab" in sections
    for name in ("ncclNetSocketIsend", "ncclIbIsend"):
        rows = [ln.split() for ln in symtab.splitlines() if ln.split()[-1:] == [name]]
        assert rows and all(r[3:5] == ["FUNC", "LOCAL"] and int(r[2]) > 0 for r in rows), rows
        assert name not in dynsym.stdout
        assert any(ln.split()[1:] == ["t", name] for ln in nm.splitlines()), name
