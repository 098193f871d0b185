"""The simulated libcuda/libnccl are faithful where the probes rely on them, and `argus sim run`
runs every layout and fault with the step times the cost model predicts."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from argus.sim import faults as faults_mod
from argus.sim.launcher import SimConfig, SimJob
from argus.sim.workload import PRESETS, predict_step_s
from tests.helpers import run_argus

TARGET = Path(__file__).parent / "targets" / "sim_pair.py"


def pair(scenario: str, tmp_path: Path, ranks: int = 2) -> Dict[int, dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(TARGET), scenario, str(r), str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for r in range(ranks)
    ]
    out = {}
    for p in procs:
        stdout, _ = p.communicate(timeout=60)
        if stdout.strip():
            rec = json.loads(stdout.strip().splitlines()[-1])
            out[rec["rank"]] = rec
    return out


def test_async_allreduce_returns_before_peer_and_late_rank_delays_completion(tmp_path: Path) -> None:
    res = pair("late", tmp_path)
    # rank 0 enqueues while rank 1 is still 0.5 s away: the call returns at once ...
    assert res[0]["enqueue_s"] < 0.01
    # ... and its stream completes only after the late rank arrives.
    assert 0.45 < res[0]["sync_wait_s"] < 0.7
    # the late rank itself barely waits
    assert res[1]["sync_wait_s"] < 0.1


def test_event_elapsed_time_is_the_modelled_gpu_time(tmp_path: Path) -> None:
    res = pair("elapsed", tmp_path, ranks=1)
    # the kernel's modelled 50 ms, plus the host's delay between recording the start event and
    # launching on the idle stream (the virtual GPU clock starts the kernel then): tens of µs,
    # a few ms at most on a loaded 2-core machine
    assert 49.95 <= res[0]["elapsed_ms"] <= 52.0, res


def test_hang_really_blocks_until_the_peer_arrives(tmp_path: Path) -> None:
    res = pair("hang", tmp_path)
    assert res[0]["blocked_after_2s"] is True
    assert 2.9 < res[0]["sync_total_s"] < 4.0


def test_dead_peer_fails_the_stream_instead_of_hanging(tmp_path: Path) -> None:
    res = pair("dead", tmp_path)
    assert res[0]["sync_rc"] == 719  # CUDA_ERROR_LAUNCH_FAILED
    assert res[0]["sync_wait_s"] < 5


def test_fault_spec_parsing() -> None:
    f = faults_mod.parse("straggler:rank=3,factor=1.5,from_step=10", world=8)
    assert (f.kind, f.rank, f.factor, f.from_step) == ("straggler", 3, 1.5, 10)
    link = faults_mod.parse("slow_link:ranks=2-3,factor=4", world=8)
    assert link.ranks == (2, 3) and link.to_dict()["ranks"] == [2, 3]
    for bad, why in [
        ("straggler:rank=9,factor=2", "rank"),
        ("nope:rank=1", "unknown fault kind"),
        ("host_stall:rank=1", "step=S"),
        ("straggler:rank=1,factor=x", "bad number"),
        ("slow_link:ranks=2-2", "distinct"),
        ("straggler:rank=1,colour=2", "unknown key"),
    ]:
        with pytest.raises(faults_mod.FaultSpecError, match=why):
            faults_mod.parse(bad, world=8)
    with pytest.raises(faults_mod.FaultSpecError, match="only 5 steps"):
        faults_mod.parse("gc_pause:rank=1,step=7,seconds=1", world=8, steps=5)


def test_bad_inject_is_a_usage_error_not_a_traceback() -> None:
    res = run_argus("sim", "run", "--ranks", "4", "--inject", "straggler:rank=7,factor=2")
    assert res.returncode == 2
    assert "ERROR: bad --inject" in res.stderr and "HINT:" in res.stderr
    assert "Traceback" not in res.stderr


def run_job(**kw: object) -> SimJob:
    job = SimJob(SimConfig(**{"timers": True, **kw}))  # type: ignore[arg-type]
    job.start()
    job.wait()
    return job


def test_straggler_run_matches_the_cost_model(tmp_path: Path) -> None:
    """`argus sim run --ranks 8 --steps 50 --inject straggler:rank=3,factor=1.5` as the issue asks."""
    steps_file = tmp_path / "steps.json"
    truth_file = tmp_path / "truth.json"
    res = run_argus(
        "sim",
        "run",
        "--ranks",
        "8",
        "--steps",
        "50",
        "--inject",
        "straggler:rank=3,factor=1.5",
        "--json-steps",
        str(steps_file),
        "--truth",
        str(truth_file),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    steps = json.loads(steps_file.read_text())
    assert len(steps["step_seconds"]) == 50 and set(steps["ranks"]) == {str(r) for r in range(8)}
    measured = statistics.median(steps["step_seconds"][2:])
    w = PRESETS["default"]
    assert measured == pytest.approx(predict_step_s(w, "dp", 8, compute_factor=1.5).total, rel=0.10)
    truth = json.loads(truth_file.read_text())
    assert truth["faults"][0]["kind"] == "straggler" and truth["faults"][0]["ranks"] == [3]
    assert truth["faults"][0]["onset_step"] == 0 and truth["steps_completed"] == 50
    # and without the fault the job runs at the unfaulted model's pace
    base = run_job(ranks=8, steps=15, run_dir=str(tmp_path / "base"))
    assert statistics.median(base.job_step_seconds()[2:]) == pytest.approx(
        predict_step_s(w, "dp", 8).total, rel=0.10
    )


def records(job: SimJob, rank: int) -> List[dict]:
    return job.ranks[rank].records


@pytest.mark.parametrize("layout", ["dp", "tp-dp", "pp-dp"])
def test_layouts_issue_the_collectives_they_should(layout: str, tmp_path: Path) -> None:
    job = run_job(ranks=4, steps=4, layout=layout, preset="small", run_dir=str(tmp_path))
    w = job.w
    meta = job.ranks[1].meta
    assert meta is not None
    rec = records(job, 1)[-1]
    if layout == "dp":
        assert rec["colls"]["AllReduce"][0] == w.layers
        assert meta["comms"]["dp"]["nranks"] == 4
    elif layout == "tp-dp":
        assert rec["colls"]["AllReduce"][0] == w.layers + 4 * w.layers
        assert meta["comms"]["tp"]["nranks"] == 2 and meta["comms"]["dp"]["nranks"] == 2
    else:
        assert rec["colls"]["Send"][0] == w.microbatches and rec["colls"]["Recv"][0] == w.microbatches
        assert rec["colls"]["AllReduce"][0] == w.layers // w.pp
    # ranks agree on the identity of shared communicators
    assert job.ranks[0].meta["comms"]["world"]["hash"] == meta["comms"]["world"]["hash"]
    assert sum(rec["launches"].values()) > 0 and set(rec["timers_ms"]) == {
        "forward",
        "backward",
        "optimizer",
        "grad_sync",
    }


def test_sequence_parallel_micro_batches_issue_megatron_collectives(tmp_path: Path) -> None:
    """seq_parallel: per layer and micro-batch 4 TP collectives forward (2 all-gathers, 2
    reduce-scatters) and 6 backward (4 all-gathers, 2 reduce-scatters); gradients once a step."""
    over = {"seq_parallel": 1, "grad_accum": 3}
    job = run_job(ranks=4, steps=3, layout="tp-dp", preset="small", overrides=over, run_dir=str(tmp_path))
    w = job.w
    for r in range(4):
        rec = records(job, r)[-1]
        layer_mbs = w.layers * 3
        assert rec["colls"]["AllGather"][0] == 6 * layer_mbs
        assert rec["colls"]["ReduceScatter"][0] == 4 * layer_mbs
        assert rec["colls"]["AllReduce"][0] == w.layers  # DP buckets after the last micro-batch
        assert rec["colls"]["AllGather"][1] == 6 * layer_mbs * (w.act_bytes // 2 // w.tp)
        assert rec["launches"]["gemm_qkv_fwd"] == layer_mbs and rec["launches"]["cross_entropy_bwd"] == 3
    # micro-batches split the work: the modelled step is that of one batch plus the TP traffic
    measured = statistics.median(job.job_step_seconds()[1:])
    assert measured == pytest.approx(predict_step_s(w, "tp-dp", 4).total, rel=0.15)


def test_tp_preset_has_the_rates_of_a_megatron_tp8_rank(tmp_path: Path) -> None:
    """The tp preset on 8 ranks: >= 10,000 launches and >= 2,000 collectives per rank-step, 1-3 s
    steps (argus/sim/workload.py says where each number comes from)."""
    w = PRESETS["tp"]
    model = predict_step_s(w, "tp-dp", 8).total
    assert 1.0 < model < 3.0
    job = run_job(ranks=8, steps=2, layout="tp-dp", preset="tp", run_dir=str(tmp_path))
    for r in range(8):
        for rec in records(job, r):
            assert sum(rec["launches"].values()) == 10_267
            assert {op: n for op, (n, _) in rec["colls"].items()} == {
                "AllGather": 1_920,
                "ReduceScatter": 1_280,
                "AllReduce": 40,
            }
    assert max(job.job_step_seconds()) == pytest.approx(model, rel=0.15)


def test_hang_fault_holds_then_reports(tmp_path: Path) -> None:
    job = run_job(
        ranks=4,
        steps=6,
        preset="small",
        injects=["hang:rank=2,step=3"],
        hang_hold_s=2.0,
        run_dir=str(tmp_path),
    )
    assert job.hung
    truth = job.truth()
    assert truth["faults"][0]["hang"]["dp_seq"] == 1 + 3 * job.w.layers
    assert all(len(job.ranks[r].records) == 3 for r in range(4))


def test_host_side_faults_lengthen_the_right_steps(tmp_path: Path) -> None:
    job = run_job(
        ranks=4,
        steps=7,
        preset="small",
        run_dir=str(tmp_path),
        injects=["host_stall:rank=1,step=3,seconds=0.6", "dataloader_stall:rank=2,step=5,seconds=0.4"],
    )
    times = job.job_step_seconds()
    base = statistics.median(times[:3])
    assert times[3] == pytest.approx(base + 0.6, abs=0.1)
    assert times[5] == pytest.approx(base + 0.4, abs=0.1)
    assert records(job, 1)[3]["host_stall_s"] == 0.6
