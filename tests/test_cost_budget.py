"""Cost budget: the BPF run time `argus probe` adds per rank-step, by the kernel's own accounting.

A regression guard that does not read step time: the simulated 8-rank job (default preset) runs
under `argus probe` with its default channels and every launch probed (`--launch-steps all`: with
the default launch windows, whether the 5 s window holds a launch window is chance), and
`benchmarks/bpf_breakdown.measure` reads each of the probe's programs' run_cnt and run_time_ns
(kernel.bpf_stats_enabled) over 5 s of steps, divided by the rank-steps the ranks' own records put
in that window. The job runs its own build of the simulated libraries, so another simulated job on
this machine does not fire these uprobes.

Two kinds of program:

* call-driven (uprobes on libcuda/libnccl): their runs follow the calls the ranks make, so runs
  per rank-step are counts, checked against the ranks' own ground truth (a launch program runs at
  most once per launch, a collective's entry and return programs once per collective), and their
  ns per rank-step must stay under BUDGET_CALL_YARDS yardsticks (a fixed program timed in the same test);
* machine-driven (the sched_switch tracepoint runs at every context switch on the machine, the
  samplers at a fixed rate per CPU): their runs follow the machine, not the job (the tracepoint ran
  137 times per rank-step on a quiet machine and 1,179 with another engineer's tests running), so
  they are judged by ns per run, and the sampler by its rate.
"""

from __future__ import annotations

import os
import time

import pytest

from argus.probes.libcuda import LAUNCH_CALLS

pytestmark = [pytest.mark.slow, pytest.mark.bpf]

# BPF run time per rank-step of the call-driven programs, default preset, every launch probed, in
# yardsticks: the ns per run of benchmarks/bpf/yardstick.bpf.c (a fixed program of a probe's usual
# shape) measured in the same test. Per-run costs move 2-3x between days of the same VM kind
# (2026-12-05: the launch program ~200 ns a run; 2026-12-06 on kernel 6.18: ~510 ns), which a
# budget in ns could only absorb by being 3x loose; in yardsticks the day cancels out.
# Recorded 2026-12-06: 2,486 yardsticks (503 µs at 202 ns; the programs before that day's in-place
# map writes: ~3,090). Budget: 2x.
BUDGET_CALL_YARDS = 5_000
# ns per run of the machine-driven programs: 93-357 ns (sched_switch) and 581-774 ns (py_on_cpu)
# today, 837-906 and 1,927-2,327 on 2026-12-03 (8.1), 1,449 and 3,781 with a busy deep-stacked
# Python worker (8.3); 2x the largest.
BUDGET_NS_PER_RUN = {"sched__sched_sw": 3_000, "py_on_cpu": 8_000, "host_on_cpu": 8_000}
# call-driven runs per rank-step other than launches and collectives (event records and their
# returns, stream waits, event queries, syncs, copies, allocations): 591 measured 2026-12-06 (146 +
# 146 event-query entry/return: the caching allocator's per-layer queries and ProcessGroupNCCL's
# watchdog; 96 + 96 event record entry/return, 48 + 48 stream waits, 1 per sync, copy, alloc,
# free), a count set by the simulated trainer's calls per step (a stock PyTorch job, no timers):
# +20% for the window's edges (re-record it when the trainer changes what it calls)
BUDGET_OTHER_RUNS = 710
PYTHON_HZ = 49  # argus probe's default Python sampling rate, per CPU

NCCL_OPS = ("AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "Send", "Recv")


def prog_names(call: str) -> set:
    """The names (cut at 15 characters, as the kernel keeps them) of a call's entry/return programs."""
    return {f"{call}_entry"[:15], f"{call}_return"[:15]}


LAUNCH_NAMES = set().union(*(prog_names(c) for c in LAUNCH_CALLS))
NCCL_NAMES = {op: prog_names(f"nccl{op}") for op in NCCL_OPS}


def test_bpf_run_time_per_rank_step_stays_within_budget() -> None:
    from benchmarks import bpf_breakdown

    t0 = time.monotonic()
    b = bpf_breakdown.measure(8, 5.0, ["--launch-steps", "all"])
    took = time.monotonic() - t0
    table = "\n".join(f"  {n:16s} {runs:8.1f} runs/rank-step {ns:7.0f} ns/run" for n, runs, ns in b.rows)
    about = (
        f"{b.rank_steps:.1f} rank-steps in {b.window_s:.1f} s, {b.step_s * 1e3:.0f} ms steps, "
        f"issued per rank-step: {b.launches:.0f} launches, collectives {b.colls}; measured in {took:.0f} s\n"
        f"{table}"
    )
    print(about)
    assert b.rank_steps > 50, f"too few steps in the window to judge:\n{about}"
    assert b.launches > 0 and b.colls.get("AllReduce", 0) > 0, about

    # Calls are counted per step (the ranks' records) and a window edge cuts a step in two: the
    # runs in the window and the calls put in it differ by up to a step per rank at each edge
    # (~4% of 26 steps), hence 10% on the counts below; twice the runs still fails.
    call_ns = other_runs = 0.0
    launch_runs = 0.0
    for name, runs, ns in b.rows:
        if name in BUDGET_NS_PER_RUN:
            assert ns <= BUDGET_NS_PER_RUN[name], f"{name}: {ns:.0f} ns per run:\n{about}"
            if name == "py_on_cpu":  # a fixed rate per CPU, whatever runs
                rate = runs * b.rank_steps / b.window_s
                cap = 1.15 * PYTHON_HZ * (os.cpu_count() or 1)
                assert rate <= cap, f"py_on_cpu ran {rate:.0f} times a second:\n{about}"
            continue
        call_ns += runs * ns
        if name in LAUNCH_NAMES:
            # at most once per launch (entry only: launch returns are off by default)
            assert runs <= 1.1 * b.launches + 0.5, f"{name}: {runs:.1f} runs per rank-step:\n{about}"
            launch_runs += runs
            continue
        op = next((op for op, names in NCCL_NAMES.items() if name in names), None)
        if op is not None:
            # an entry and a return program per collective, each once per call
            calls = b.colls.get(op, 0.0)
            assert runs <= 1.1 * calls + 0.5, f"{name}: {runs:.1f} runs, {calls:.1f} {op} calls:\n{about}"
            continue
        other_runs += runs
    print(f"call-driven: {call_ns / 1e3:.1f} µs per rank-step, {other_runs:.1f} other runs per rank-step")
    # every launch was probed, or the budget below would be met by probing less
    assert launch_runs >= 0.9 * b.launches, f"launch programs ran {launch_runs:.0f} times:\n{about}"
    assert other_runs <= BUDGET_OTHER_RUNS, f"{other_runs:.0f} other call-driven runs:\n{about}"
    yard = bpf_breakdown.yardstick_ns()
    print(f"yardstick: {yard:.0f} ns per run; call-driven: {call_ns / yard:.0f} yardsticks per rank-step")
    assert call_ns <= BUDGET_CALL_YARDS * yard, (
        f"call-driven BPF run time {call_ns / 1e3:.0f} µs per rank-step = {call_ns / yard:.0f} yardsticks "
        f"of {yard:.0f} ns, budget {BUDGET_CALL_YARDS}:\n{about}"
    )
