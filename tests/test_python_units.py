"""Pure parts of the Python, host and record channels: phase rules, folding, qualnames from source,
per-step sections, USDT argument parsing, the offset table against each interpreter's headers, and
the trace builder and its schema check. No root needed."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from argus.agent.phases import (
    DEFAULT_PHASES,
    OTHER,
    PhaseMatcher,
    PhaseSpecError,
    fold,
    parse_phase_option,
)
from argus.agent.pysection import HostSection, PythonSection
from argus.agent.trace import Names, TraceBuilder, validate
from argus.probes import cpython_offsets, libcuda, libnccl, usdt
from argus.probes.base import call_id
from argus.probes.cpython import Frame, qualnames_of
from argus.probes.records import (
    PROF_OFFCPU,
    PROF_ONCPU,
    USDT_ARG_MEM,
    USDT_ARG_REG,
    RecElapsed,
    RecHdr,
    RecOffcpu,
    RecPyCall,
    RecPyMark,
    RecPySample,
)
from tests.helpers import cpython_header_sets

assert libcuda.CHANNEL and libnccl.CHANNEL  # imported for their calls' ids and classes (the call table)


def F(q: str, path: str = "/x/train.py") -> Frame:
    return Frame(q, path, 1)


def stack(*outer_first: str) -> List[Frame]:
    """Frames innermost first (as walked) from names given outermost first."""
    return [F(q) for q in reversed(outer_first)]


# ---- phase rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames,phase",
    [
        # the simulated trainer (argus/sim/trainer.py)
        (("main", "Trainer.train", "Trainer.train_step", "DataLoader.__next__"), "data"),
        (("Trainer.train_step", "Model.forward", "TransformerLayer.forward", "Trainer.launch"), "forward"),
        (("Trainer.train_step", "Model.backward", "TransformerLayer.backward"), "backward"),
        (("Trainer.train_step", "Model.backward", "Trainer.reduce_bucket", "Nccl.all_reduce"), "backward"),
        (("Trainer.train_step", "Trainer.finish_grad_sync", "Cuda.record"), "backward"),
        (("Trainer.train_step", "Optimizer.step", "Trainer.launch"), "optimizer"),
        (("Trainer.train_step", "KernelCompiler.compile", "KernelCompiler.codegen"), "compile"),
        (("Trainer.train_step", "Cuda.sync"), OTHER),
        # PyTorch eager, DDP
        (
            ("train", "Module._wrapped_call_impl", "Module._call_impl", "Net.forward", "Linear.forward"),
            "forward",
        ),
        (("train", "Tensor.backward", "backward", "_engine_run_backward"), "backward"),
        (
            (
                "train",
                "Optimizer.profile_hook_step.<locals>.wrapper",
                "Adam.step",
                "adam",
                "_multi_tensor_adam",
            ),
            "optimizer",
        ),
        (("train", "_BaseDataLoaderIter.__next__", "_SingleProcessDataLoaderIter._next_data"), "data"),
        (("train", "Optimizer.zero_grad"), "optimizer"),
        # activation checkpointing: forward recomputed inside backward is backward
        (("train", "Tensor.backward", "CheckpointFunction.backward", "Block.forward"), "backward"),
        # Megatron-LM
        (
            (
                "pretrain",
                "train",
                "train_step",
                "forward_backward_no_pipelining",
                "forward_step",
                "get_batch",
            ),
            "data",
        ),
        (("train_step", "forward_backward_no_pipelining", "forward_step", "GPTModel.forward"), "forward"),
        (("train_step", "forward_backward_no_pipelining", "backward_step"), "backward"),
        (("train_step", "DistributedOptimizer.step"), "optimizer"),
        (("train", "evaluate_and_print_results", "evaluate", "forward_step"), "evaluation"),
        (("train", "save_checkpoint_and_time", "save_checkpoint"), "checkpoint"),
        # DeepSpeed
        (("train", "DeepSpeedEngine.forward"), "forward"),
        (("train", "DeepSpeedEngine.backward"), "backward"),
        (("train", "DeepSpeedEngine.step"), "optimizer"),
        (("train", "RepeatingLoader.__next__"), "data"),
        # Lightning: the closure runs inside optimizer.step
        (("fit", "Adam.step", "Closure.__call__", "LitModel.training_step"), "forward"),
        # the test target (tests/targets/py_phases.py)
        (("<module>", "main", "train_step", "optimizer_step", "spin"), "optimizer"),
    ],
)
def test_default_phases(frames: Tuple[str, ...], phase: str) -> None:
    assert PhaseMatcher().phase_of(stack(*frames)) == phase


def test_path_patterns_and_precedence() -> None:
    m = PhaseMatcher()
    save = [Frame("save", "/site-packages/torch/serialization.py", 1), Frame("train", "/x.py", 1)]
    assert m.phase_of(save) == "checkpoint"
    assert m.phase_of([Frame("save", "/x/mine.py", 1)]) == OTHER
    assert m.phase_of([Frame("compile", "/usr/lib/python3.11/re/__init__.py", 1)]) == OTHER  # re.compile
    user = PhaseMatcher([("loss", "compute_loss"), ("forward", "*.predict")])
    assert user.phases[:2] == ("loss", "forward")
    assert user.phase_of(stack("train", "Net.forward", "compute_loss")) == "loss"  # user rules first
    assert user.phase_of(stack("train", "Net.predict")) == "forward"
    only = PhaseMatcher([("step", "train_step")], defaults=False)
    assert only.phase_of(stack("train_step", "Net.forward")) == "step"
    assert only.phases == ("step",)
    assert set(DEFAULT_PHASES) == {
        "compile",
        "data",
        "checkpoint",
        "evaluation",
        "backward",
        "forward",
        "optimizer",
    }


def test_phase_option_parsing() -> None:
    assert parse_phase_option("fwd=MyModel.forward") == ("fwd", "MyModel.forward")
    assert parse_phase_option(" io = */data/*:* ") == ("io", "*/data/*:*")
    for bad in ("fwd", "=x", "fwd=", "bad name=x"):
        with pytest.raises(PhaseSpecError):
            parse_phase_option(bad)


def test_fold_keeps_outermost_and_innermost() -> None:
    frames = stack(*[f"f{i}" for i in range(40)])
    assert fold(frames) == ";".join(f"f{i}" for i in range(40))
    short = fold(frames, 40)
    assert short.startswith("f0;…;") and short.endswith(";f39") and len(short) <= 44


def test_qualnames_from_source_for_3_9_and_3_10() -> None:
    src = """
class Model:
    def forward(self):
        def inner():
            pass
        return inner

    @staticmethod
    @decorated
    def helper():
        pass

def train_step():
    f = lambda: 1
"""
    q = qualnames_of(src)
    assert q[(3, "forward")] == "Model.forward"
    assert q[(4, "inner")] == "Model.forward.<locals>.inner"
    assert q[(8, "helper")] == q[(10, "helper")] == "Model.helper"  # first decorator's line too
    assert q[(13, "train_step")] == "train_step"
    assert q[(14, "<lambda>")] == "train_step.<locals>.<lambda>"
    assert qualnames_of("def broken(:") == {}


# ---- sections ------------------------------------------------------------------------------------


def hdr(kind: int, call: str, ts: int, epoch: int = 0, tgid: int = 100, tid: int = 100) -> RecHdr:
    return RecHdr(kind=kind, tgid=tgid, tid=tid, call=call_id(call) if call else 0, ts=ts, epoch=epoch)


def mark(
    call: str, ts: int, stack_id: int, aux: int = 0, weight: int = 1, epoch: int = 0, events: int = 0
) -> RecPyMark:
    return RecPyMark(h=hdr(7, call, ts, epoch), stack=stack_id, aux=aux, weight=weight, events=events)


def make_section() -> PythonSection:
    stacks: Dict[int, List[Frame]] = {
        1: stack("train_step", "forward"),
        2: stack("train_step", "backward"),
        3: stack("train_step", "optimizer_step", "spin"),
        4: stack("train_step", "sync"),
        9: stack("worker_loop"),
    }
    return PythonSection(100, "3.11", 99, PhaseMatcher(), stacks.get, lambda c: f"fn{c}", top_stacks=3)


def test_python_section_phases_threads_stacks_and_calls() -> None:
    sec = make_section()
    sec.add_prof(5, 100, 1, PROF_ONCPU, 30, 300)
    sec.add_prof(5, 100, 1, PROF_OFFCPU, 4, 200)
    sec.add_prof(6, 100, 2, PROF_OFFCPU, 2, 500)
    sec.add_prof(6, 100, 3, PROF_ONCPU, 10, 100)
    sec.add_prof(6, 101, 9, PROF_OFFCPU, 1, 1000)  # another thread
    sec.add_prof(9, 100, 4, PROF_ONCPU, 1, 7)  # a later step
    sec.on_mark(mark("cuLaunchKernel", 10, 1, weight=16, epoch=5))
    sec.on_mark(mark("cuStreamSynchronize", 20, 4, epoch=6))
    sec.on_mark(mark("ncclAllReduce", 30, 2, epoch=6))
    assert sec.epochs() == {5, 6, 9}
    out = sec.summarize([5, 6])
    assert out is not None
    assert out["thread"] == 100
    assert out["phases"] == {"backward": 500, "forward": 500, "optimizer": 100}
    assert out["samples"] == 40 and out["offcpu_ns"] == 700
    assert out["threads"] == {"101": {"ns": 1000, "phase": OTHER}}
    assert next(iter(out["stacks"])) == "worker_loop" and len(out["stacks"]) == 3
    assert out["calls"] == {"forward": {"launches": 16}, OTHER: {"syncs": 1}, "backward": {"collectives": 1}}
    assert sec.epochs() == {9}
    assert sec.summarize([5, 6]) is None


def timer(read: int, start_ns: int, end_ns: int, ms: float) -> RecElapsed:
    """A cuEventElapsedTime record: BPF adds the two recordings' times as they were at the read."""
    bits = int.from_bytes(__import__("struct").pack("<f", ms), "little")
    t = RecElapsed(h=hdr(4, "", read), start_ev=0xA, end_ev=0xB, ms_bits=bits, result=0)
    t.start_ns, t.end_ns, t.start_pos, t.end_pos = start_ns, end_ns, 1 if start_ns else 0, 2 if end_ns else 0
    return t


def test_timers_get_the_phase_between_their_events() -> None:
    sec = make_section()
    # event recordings at 100 (outside the phase: train_step), 200, 210 and 300; each forces a walk
    # at its thread's next launch, whose record counts it (BPF: python.bpf.c PY_HIT_EVENT)
    sec.on_mark(mark("cuLaunchKernel", 110, 1, events=1))  # forward
    sec.on_mark(mark("cuLaunchKernel", 150, 1, weight=16))
    sec.on_mark(mark("cuLaunchKernel", 220, 3, events=2))  # optimizer
    sec.add_prof(0, 100, 1, PROF_ONCPU, 1, 1)
    timers = [
        timer(400, 100, 200, 2.5),
        timer(400, 210, 300, 1.0),
        timer(400, 200, 210, 0.5),  # nothing inside
        timer(400, 100, 0, 9.0),  # an event recorded before we attached: not labelled
    ]
    out = sec.summarize([0], timers)
    assert out is not None
    assert out["gpu_phases"] == {"forward": 2_500_000, "optimizer": 1_000_000, OTHER: 500_000}
    assert out["calls"] == {
        "forward": {"launches": 17, "event_records": 1},
        "optimizer": {"launches": 1, "event_records": 2},
    }


def test_a_timer_summarized_after_the_next_steps_walks_keeps_its_own_interval() -> None:
    """Under load the agent may summarize a step after the next step's walks arrived: the timer
    still takes the phase between its own recordings (BPF gives their times at its read, before
    the next step recorded the same events again)."""
    sec = make_section()
    sec.on_mark(mark("cuLaunchKernel", 110, 1))  # forward
    t = timer(250, 100, 200, 2.0)
    sec.on_mark(mark("cuLaunchKernel", 310, 3))  # the next step's optimizer
    sec.add_prof(0, 100, 1, PROF_ONCPU, 1, 1)
    out = sec.summarize([0], [t])
    assert out is not None and out["gpu_phases"] == {"forward": 2_000_000}, out


def test_gc_and_precise_summaries() -> None:
    sec = make_section()
    sec.add_gc(3, 0, 10, 1000, 300, 50)
    sec.add_gc(3, 2, 1, 5000, 5000, 7)
    sec.on_call(RecPyCall(h=hdr(10, "", 1500, 3), code=7, enter_ns=1000))
    sec.on_call(RecPyCall(h=hdr(10, "", 2600, 3), code=7, enter_ns=2000))
    out = sec.summarize([3])
    assert out is not None
    assert out["gc"] == {
        "count": 11,
        "pause_ns": 6000,
        "max_ns": 5000,
        "collected": 57,
        "by_gen": {"0": {"count": 10, "pause_ns": 1000}, "2": {"count": 1, "pause_ns": 5000}},
    }
    assert out["precise"] == {"fn7": {"count": 2, "ns": 1100, "max_ns": 600}}


def test_host_section() -> None:
    folded = {(1, 5, -1): "main;compute", (2, -1, 9): "worker;futex_wait_[k]"}
    sec = HostSection(1, 19, lambda t, u, k: folded[(t, u, k)], lambda t: f"t{t}", top_stacks=5)
    sec.add_prof(0, 1, 5, -1, PROF_ONCPU, 3, 300)
    sec.add_prof(0, 2, -1, 9, PROF_OFFCPU, 1, 900)
    out = sec.summarize([0])
    assert out == {
        "hz": 19,
        "on_cpu_ns": 300,
        "off_cpu_ns": 900,
        "threads": {
            "2": {"name": "t2", "on_ns": 0, "off_ns": 900},
            "1": {"name": "t1", "on_ns": 300, "off_ns": 0},
        },
        "stacks": {"worker;futex_wait_[k]": 900, "main;compute": 300},
    }


# ---- USDT ------------------------------------------------------------------------------------------


def test_usdt_argument_specs() -> None:
    a = usdt.parse_arg("-4@112(%rsp)")
    assert a is not None and (a.kind, a.reg, a.size, a.is_signed, a.offset) == (USDT_ARG_MEM, 19, 4, 1, 112)
    b = usdt.parse_arg("-8@%r12")
    assert b is not None and (b.kind, b.reg, b.size, b.is_signed) == (USDT_ARG_REG, 3, 8, 1)
    c = usdt.parse_arg("4@$7")
    assert c is not None and c.offset == 7
    assert usdt.parse_arg("3@%rax") is None and usdt.parse_arg("8@%xmm0") is None


@pytest.mark.skipif(not Path("/usr/bin/python3.11").exists(), reason="no Debian /usr/bin/python3.11")
def test_usdt_notes_of_debian_python() -> None:
    found = {p.name: p for p in usdt.probes("/usr/bin/python3.11")}
    if not found:
        pytest.skip("this python3.11 has no USDT probes")
    assert {"gc__start", "gc__done"} <= set(found)
    assert found["gc__start"].semaphore and usdt.parse_arg(found["gc__done"].args[0]) is not None


# ---- offsets ----------------------------------------------------------------------------------------


def _header_sets() -> List[Tuple[str, Tuple[int, int], Tuple[str, ...]]]:
    return cpython_header_sets(cpython_offsets.TABLE)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize(
    "label,version,include",
    _header_sets()
    or [pytest.param("", (0, 0), (), marks=pytest.mark.skip(reason="no CPython headers here"))],
)
def test_offset_table_matches_each_interpreters_headers(
    label: str, version: Tuple[int, int], include: Tuple[str, ...]
) -> None:
    derived = cpython_offsets.derive(include)
    assert derived == cpython_offsets.TABLE[version], label


def test_every_layout_fits_the_walks_one_read_per_frame() -> None:
    """argus/bpf/python.bpf.c reads PY_FRAME_READ bytes per frame; code, caller and owner come from them."""
    h = (Path(__file__).resolve().parents[1] / "argus" / "bpf" / "records.h").read_text()
    assert f"#define PY_FRAME_READ {cpython_offsets.PY_FRAME_READ} " in h
    for version, offsets in cpython_offsets.TABLE.items():
        assert offsets.frame_fields_fit(), version
    bad = dataclasses.replace(cpython_offsets.TABLE[(3, 12)], frame_owner=cpython_offsets.PY_FRAME_READ)
    assert not bad.frame_fields_fit()
    assert not dataclasses.replace(bad, frame_owner=cpython_offsets.NONE, frame_back=64).frame_fields_fit()


def test_supported_window() -> None:
    assert cpython_offsets.SUPPORTED == ((3, 9), (3, 10), (3, 11), (3, 12), (3, 13))
    assert cpython_offsets.SUPPORTED_TEXT == "3.9-3.13"


# ---- trace ------------------------------------------------------------------------------------------


def test_trace_builder_output_is_valid_and_nested() -> None:
    frames = {1: stack("main", "train_step", "forward"), 2: stack("main", "train_step", "backward")}
    names = Names(
        frames=lambda pid, s: frames.get(s),
        phase=lambda pid, s: PhaseMatcher().phase_of(frames[s]),
        rank={100: 3},
        period_ns=10_000_000,
    )
    t0 = 1_000_000_000
    recs = [
        RecPySample(h=hdr(8, "", t0 + 5_000_000), stack=1, ustack=-1, kstack=-1),
        RecPySample(h=hdr(8, "", t0 + 15_000_000), stack=1, ustack=-1, kstack=-1),
        RecOffcpu(h=hdr(9, "", t0 + 60_000_000), start_ns=t0 + 25_000_000, stack=2, ustack=-1, kstack=-1),
        RecOffcpu(
            h=hdr(9, "", t0 + 1_000_000), start_ns=t0 - 5_000_000, stack=1, ustack=-1, kstack=-1
        ),  # before t0
    ]
    tb = TraceBuilder(names, t0)
    tb.add(recs)
    trace = tb.trace({"pids": [100]})
    assert validate(trace) == []
    json.dumps(trace)
    slices = [(e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e.get("cat") == "python"]
    assert ("main", 0.0, 60000.0) in slices  # one frame open across on- and off-CPU observations
    assert ("forward", 0.0, 25000.0) in slices and ("backward", 25000.0, 35000.0) in slices
    offs = [e for e in trace["traceEvents"] if e.get("cat") == "offcpu"]
    assert {e["args"]["phase"] for e in offs} == {"backward", "forward"}
    procs = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert procs == ["rank 3"]  # viewers add the pid: "rank 3 (pid 100)"


def test_trace_validator_catches_what_viewers_reject() -> None:
    assert validate([]) == ["top level must be an object with a traceEvents list"]
    bad = {
        "traceEvents": [
            {"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
            {"name": "b", "ph": "X", "pid": 1, "tid": 1, "ts": 5, "dur": 10},  # overlaps its parent
            {"name": "c", "ph": "Q", "pid": 1, "tid": 1, "ts": 0},
            {"name": "d", "ph": "X", "pid": "1", "tid": 1, "ts": -1, "dur": 1},
        ]
    }
    errs = validate(bad)
    assert any("bad ph" in e for e in errs) and any("integers" in e for e in errs)
    assert any("overlaps" in e for e in errs) and any("ts must be" in e for e in errs)
