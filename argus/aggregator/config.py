"""Thresholds of the diagnosis levels, with the reasoning behind each default (docs/diagnosis.md).

Every threshold is relative to something the job itself shows (its median step, its group's
median phase time, the spread its ranks showed while healthy) with an absolute floor, so the same
defaults hold for a 60 ms simulated step and a 2 s production step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Optional


@dataclass
class Thresholds:
    # ---- alignment and memory ---------------------------------------------------------------------
    #: rolling steps of history kept per job (per group and per rank); bounds memory
    window: int = 64
    #: a step is judged once every expected rank reported it, or once ranks reported `lag` later steps
    lag_steps: int = 2
    #: ... and a rank missing from a step is waited for while it reported within this much job time
    #: (agents send a rank's steps of one interval together, so the others' newer steps come first)
    lag_s: float = 3.0
    #: steps of a job seen before any level judges (noise baselines need history; a job's first
    #: steps are its noisiest: with 5, false stragglers were named at steps 8 and 9 in CI)
    warmup_steps: int = 8
    #: ... but only for a job seen from its start: one the agents attached to late is in its steady
    #: state, and a fault already present must be named within a few steps of the first aligned data
    attach_warmup_steps: int = 1
    #: ... and for this many judged steps after that warm-up, a rank is named only when flagged in
    #: every one of its last `persist_n` steps (its group's noise is barely known yet: in clean
    #: simulated runs the agent's own start-up made one rank stand out for 3 steps right after attach)
    young_steps: int = 12

    # ---- L1: iteration time -----------------------------------------------------------------------
    #: spike: step time / median of the previous `spike_window` steps (the paper's "> 2x baseline")
    spike_ratio: float = 2.0
    spike_window: int = 16
    #: ... and costs at least this much (ns): on a shared host, scheduling hiccups of tens of ms
    #: double a 50 ms step and are not actionable
    spike_min_ns: int = 100_000_000
    #: regression (change point): mean after / mean before a split of the last `regress_window` steps
    regress_ratio: float = 1.2
    regress_window: int = 32
    regress_min_segment: int = 3
    #: ... and each segment's robust spread (MAD / median) must stay below this (a level shift, not noise)
    regress_max_spread: float = 0.15
    #: an L1 finding waits this many steps for a level that explains it (then it is folded in)
    l1_hold_steps: int = 3

    # ---- L2: lateness and phases --------------------------------------------------------------------
    #: an outlier is more than `noise_k` x the group's own noise (99th percentile of |deviation| seen
    #: while healthy) ...
    noise_k: float = 1.5
    #: ... and at least this fraction of the group's median ...
    rel_min: float = 0.10
    #: ... and at least this much in absolute terms (ns)
    abs_min_ns: int = 1_000_000
    #: ... and costs at least this share of the job's step: a rank slower by less is not worth a page
    #: at 3 a.m., and on a shared host it is often real but passing CPU contention (on the 2-core CI
    #: machine, 8 simulated ranks drew clean-run "stragglers" of 4-7% of the step; faults worth naming
    #: cost 15% and more)
    share_min: float = 0.08
    #: host arrival lateness floor (ns): clock sync between hosts is ~1 ms at best
    late_min_ns: int = 2_000_000
    #: a rank is a straggler when flagged in `persist_k` of its last `persist_n` judged steps
    persist_k: int = 3
    persist_n: int = 4
    #: a phase outlier whose extra time is at least this share the rank's own host time (outside GPU
    #: waits) is host-bound: its host launched the work late (CPU contention, a noisy neighbour, GC),
    #: which comes in bursts; a GPU-side slowdown leaves the host's own time as it was. Measured on
    #: the simulator under bursty CPU load: host-bound outliers 0.5-1.0, injected GPU faults -0.2-0.2
    host_bound_share: float = 0.4
    #: ... and a host-bound outlier names a straggler only when it held in `host_persist_k` of the
    #: rank's last `host_persist_n` steps (CPU-contention bursts made clean ranks stand out for 5-8
    #: steps in CI; at 1 s steps this names a CPU-starved rank in ~12 s)
    host_persist_k: int = 12
    host_persist_n: int = 16
    #: in a blocking communicator the host call returns when the last peer arrived, so the group's
    #: lowest wait in its collectives (`wait:coll`) is the rank the others waited for. It is flagged low
    #: when the group's median waited at least 1/`wait_order_ratio` as long, however noisy the
    #: others' waits are (they spread with the very lateness being judged): measured on the second
    #: stand-ins' pp-dp job, a slowed link's ends were that in 81-83% of steps, clean ranks in <= 1%
    wait_order_ratio: float = 0.5
    #: smallest symmetric group in which a majority can name an outlier
    min_group: int = 3
    #: two p2p peers with the same extra time (within this fraction) in every phase they both grew in
    #: point at the link between them, not at either rank. The receiving stage's copy of a phase
    #: absorbs part of a slower transfer in waits it already had: measured, its forward grew 0.6x
    #: the sender's in 3 of 8 runs of a slowed pipeline link (0.35 missed those)
    pair_equal_tol: float = 0.5
    #: a rank named the cause of a pipeline slowdown stays named while it is persistent, unless a
    #: peer's phase grew by this factor more (a noisy phase of the waiting peer flipped the cause)
    cause_keep: float = 1.25

    # ---- which GPU arrived last (argus.aggregator.gpuarrival), for jobs without timers --------------
    #: NCCL's proxy posts a rank's first network send microseconds after its GPU reached the
    #: collective and produced data: the send bounds the arrival from above within this slack (a
    #: busy host's proxy thread lags; 1 ms is far above NCCL's own latency and far below a lateness
    #: worth naming). Rank r came surely after o when send_r - slack > send_o (+ clock uncertainty)
    gpu_net_slack_ns: int = 1_000_000
    #: an event-query bound is a host timestamp beside the query or sync: a rank's lower bound must
    #: pass every peer's upper bound by this much (plus the clocks' uncertainty across hosts)
    gpu_bound_margin_ns: int = 200_000
    #: in-collective GPU times (TORCH_NCCL_ENABLE_TIMING): the rank whose median time in a
    #: communicator's collectives is below every peer's by max(abs, rel x the group's median) came
    #: last (everyone finishes together; a collective's own time varies by a few percent)
    gpu_time_tol_ns: int = 50_000
    gpu_time_tol_rel: float = 0.05
    #: ... over the times read for the last this many steps (a watchdog reads them at its own period,
    #: 100 ms in PyTorch: a step shorter than that has reads for some ranks and not others)
    gpu_coll_steps: int = 3
    #: ... and a rank is flagged only when its GPU lateness is at least max(abs, share x the median
    #: step). The lateness seen is at the first inter-host collective (network sends) or a median
    #: over the step's collectives: a part of what the rank costs the step, which grows by its
    #: lateness at the *last* collective; hence half of `share_min` (a launch gap of a few ms on a
    #: healthy rank, real but passing, stays under it)
    gpu_late_min_ns: int = 2_000_000
    gpu_late_share: float = 0.04
    #: ... and at least `noise_k` x the group's own spread in that source (first network sends,
    #: in-collective GPU times), once this many healthy deviations are known
    gpu_noise_min: int = 8
    #: ... event queries at this quantile of the members' deviations, not the 99th: a member's
    #: deviation is a median over the step's tightly bounded instances, one value a step, and the
    #: 99th of a few dozen is the few steps a rank was held up (measured, 4 launch-bound simulated
    #: ranks: peers mostly within 13 ms, in 4 of 60 values 19-43 ms; the 1.3x straggler 18-31 ms
    #: late, which the 99th kept unnamed in half of the steps); a verdict still needs 3 of 4 steps
    gpu_query_noise_q: float = 0.9

    # ---- host stall -------------------------------------------------------------------------------
    #: the rank's host reached its collectives this late: max(abs, rel x median step)
    stall_min_ns: int = 50_000_000
    stall_rel: float = 0.5
    #: ... and its own host time (outside GPU waits) explains at least this share of the lateness
    stall_host_share: float = 0.5

    # ---- L3: distributions --------------------------------------------------------------------------
    #: rank-vs-group comparison every `l3_every` steps over each rank's last `l3_window` values
    l3_every: int = 4
    l3_window: int = 16
    #: W1(rank, group median distribution) / group median beyond the IQR fence and at least this
    l3_rel: float = 0.05
    l3_fence: float = 3.0
    #: group-wide shift of a communication phase (no late rank): recent / baseline level
    link_rel: float = 0.08
    link_k: float = 4.0
    link_persist: int = 3
    link_baseline: int = 8

    # ---- hang ---------------------------------------------------------------------------------------
    #: blocked longer than max(hang_min_s, hang_steps x median step) in a sync or collective
    hang_min_s: float = 15.0
    hang_steps: float = 10.0

    # ---- missing ranks ----------------------------------------------------------------------------
    #: ranks that had reported and then sent nothing for this many judged steps and this much job
    #: time (while others kept stepping) are said missing — grouped by host — instead of being left
    #: out of the diagnosis silently. 10 s: an agent's publisher retries a refused or timed-out
    #: batch for a few seconds, and a restarted agent takes seconds to attach
    missing_steps: int = 3
    missing_s: float = 10.0

    # ---- resolution -------------------------------------------------------------------------------
    #: an alert whose condition was not seen for this many judged steps is resolved
    resolve_after: int = 5

    @classmethod
    def from_pairs(cls, pairs: List[str]) -> Thresholds:
        """Overrides as `name=value` strings (the CLI's `--set`)."""
        t = cls()
        known: Dict[str, type] = {f.name: type(getattr(t, f.name)) for f in fields(t)}
        for p in pairs:
            k, eq, v = p.partition("=")
            k = k.strip()
            if not eq or k not in known:
                raise ValueError(f"unknown threshold '{k}' (known: {', '.join(sorted(known))})")
            try:
                setattr(t, k, known[k](float(v)) if known[k] is int else known[k](v))
            except ValueError:
                raise ValueError(f"threshold {k}: '{v}' is not a number") from None
        return t


@dataclass
class PhaseInfo:
    """How to read the `timer<k>` phases: names for the report and which ones time communication.

    Roles come, in order, from `comm_phases` given here, from the phase's stream (a timer that ends
    on another stream than most timers is on a side stream: NCCL's), else they stay unknown.
    """

    names: Dict[str, str]
    comm_phases: Optional[List[str]] = None

    @classmethod
    def parse(cls, spec: Optional[str], comm: Optional[str] = None) -> PhaseInfo:
        names: Dict[str, str] = {}
        if spec:
            for i, name in enumerate(x.strip() for x in spec.split(",")):
                if name:
                    names[f"timer{i}"] = name
        comm_list = [c.strip() for c in comm.split(",") if c.strip()] if comm else None
        if comm_list:  # accept names as well as timer<k>
            rev = {v: k for k, v in names.items()}
            comm_list = [rev.get(c, c) for c in comm_list]
        return cls(names, comm_list)

    def label(self, phase: str) -> str:
        n = self.names.get(phase)
        return f"{n} ({phase})" if n else phase

    def short(self, phase: str) -> str:
        return self.names.get(phase, phase)
