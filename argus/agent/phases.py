"""Training phases from Python stacks: qualname patterns, precedence, folding. Pure.

A stack is in the phase of the highest-precedence rule that matches any of its frames. User rules
(`--phase NAME=PATTERN`) come first, in the order given; then the defaults, in this order:

    compile > data > checkpoint > evaluation > backward > forward > optimizer

so data loading inside Megatron's `forward_step` is `data`, activation recomputation inside
backward is `backward`, a Lightning closure run by `optimizer.step(closure)` is `forward` and
`backward`, and JIT compilation triggered anywhere is `compile` (the canonical host stall).
A stack no rule matches is `other`.

Patterns are shell globs over the qualname (`Model.forward`, `*.step`); `PATHGLOB:QUALGLOB`
also matches the code's file name (`*/torch/serialization.py:save`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from argus.probes.cpython import Frame

OTHER = "other"

# The defaults recognise PyTorch eager, DDP/FSDP, Megatron-LM, DeepSpeed, HF/Lightning loops and
# the simulated trainer (argus/sim/trainer.py). Order = precedence.
DEFAULT_RULES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (
        "compile",
        (
            "*.compile",
            "_compile",
            "compile_inner",
            "compile_fx",
            "compile_fx_inner",
            "fx_codegen_and_compile",
            "*.compile_to_module",
            "*.precompile",
            "*.jit_load",
            "*/triton/compiler/*:*",
        ),
    ),
    (
        "data",
        (
            "*DataLoader*.__next__",
            "*DataLoaderIter*.__next__",
            "*Loader.__next__",
            "*._next_data",
            "get_batch",
            "*.get_batch",
            "get_batch_*",
            "*.get_batch_*",
            "*Dataset*.__getitem__",
            "*collate*",
            "next_batch",
            "*.next_batch",
            "*Prefetcher*.next",
        ),
    ),
    (
        "checkpoint",
        (
            "save_checkpoint",
            "*.save_checkpoint",
            "*_save_checkpoint",
            "load_checkpoint",
            "*.load_checkpoint",
            "*.save_pretrained",
            "save_model",
            "*.save_model",
            "*/torch/serialization.py:save",
            "*/torch/serialization.py:load",
            "*/torch/distributed/checkpoint/*:*",
        ),
    ),
    (
        "evaluation",
        (
            "evaluate",
            "*.evaluate",
            "evaluate_*",
            "evaluation_loop",
            "*.evaluation_loop",
            "validate",
            "*.validate",
            "*.validation_step",
            "eval_step",
            "*.eval_step",
            "*.prediction_step",
        ),
    ),
    (
        "backward",
        (
            "backward",
            "*.backward",
            "_engine_run_backward",
            "backward_step",
            "*.backward_step",
            "*finish_grad_sync",
            "*.allreduce_gradients",
            "*.reduce_gradients",
            "*_post_backward_hook",
            "*.manual_backward",
        ),
    ),
    (
        "forward",
        (
            "forward",
            "*.forward",
            "forward_step",
            "*.forward_step",
            "*.training_step",
        ),
    ),
    (
        "optimizer",
        (
            "*.step",
            "optimizer_step",
            "*.optimizer_step",
            "zero_grad",
            "*.zero_grad",
            "_multi_tensor_*",
            "_single_tensor_*",
            "_fused_*",
            "*clip_grad_norm*",
            "*.step_with_ready_grads",
            "*profile_hook_step*",
        ),
    ),
)
DEFAULT_PHASES = tuple(name for name, _ in DEFAULT_RULES)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")


class PhaseSpecError(ValueError):
    pass


def parse_phase_option(text: str) -> Tuple[str, str]:
    """`NAME=PATTERN` (the --phase option)."""
    name, eq, pattern = text.partition("=")
    name, pattern = name.strip(), pattern.strip()
    if not eq or not pattern:
        raise PhaseSpecError(f"'{text}' is not NAME=PATTERN (e.g. forward=MyModel.forward)")
    if not _NAME.match(name):
        raise PhaseSpecError(f"phase name '{name}' must be a short identifier (letters, digits, _ . -)")
    return name, pattern


@dataclass(frozen=True)
class Rule:
    phase: str
    pattern: str
    rank: int  # precedence: lower wins
    path_rx: Optional[re.Pattern[str]]
    qual_rx: re.Pattern[str]

    @staticmethod
    def make(phase: str, pattern: str, rank: int) -> Rule:
        path, sep, qual = pattern.rpartition(":")
        path_rx = re.compile(fnmatch.translate(path)) if sep and path else None
        return Rule(phase, pattern, rank, path_rx, re.compile(fnmatch.translate(qual if sep else pattern)))

    def matches(self, f: Frame) -> bool:
        if self.path_rx is not None and not self.path_rx.match(f.filename):
            return False
        return self.qual_rx.match(f.qualname) is not None


class PhaseMatcher:
    """Frame and stack -> phase, with caches (a training loop has a few hundred distinct frames)."""

    def __init__(self, user: Sequence[Tuple[str, str]] = (), defaults: bool = True) -> None:
        rules: List[Rule] = []
        names: List[str] = []
        for phase, pattern in user:
            rules.append(Rule.make(phase, pattern, len(names) if phase not in names else names.index(phase)))
            if phase not in names:
                names.append(phase)
        if defaults:
            for phase, patterns in DEFAULT_RULES:
                if phase not in names:
                    names.append(phase)
                rank = names.index(phase)
                rules.extend(Rule.make(phase, p, rank) for p in patterns)
        self.rules = rules
        self.phases: Tuple[str, ...] = tuple(names)
        self._frame: Dict[Frame, Optional[int]] = {}

    def frame_rank(self, f: Frame) -> Optional[int]:
        if f in self._frame:
            return self._frame[f]
        best = None
        for r in self.rules:
            if (best is None or r.rank < best) and r.matches(f):
                best = r.rank
        self._frame[f] = best
        return best

    def phase_of(self, frames: Iterable[Frame]) -> str:
        best = None
        for f in frames:
            r = self.frame_rank(f)
            if r is not None and (best is None or r < best):
                best = r
        return self.phases[best] if best is not None else OTHER


def fold(frames_inner_first: Sequence[Frame], max_chars: int = 0) -> str:
    """Folded stack (outermost first, ';'-separated qualnames). With max_chars, the outermost frame
    and as many innermost frames as fit are kept, '…' marking the cut."""
    names = [f.label() for f in reversed(frames_inner_first)]
    text = ";".join(names)
    if not max_chars or len(text) <= max_chars or len(names) < 3:
        return text
    head, tail = names[0], []  # type: Tuple[str, List[str]]
    budget = max_chars - len(head) - 3
    for n in reversed(names[1:]):
        if budget - len(n) - 1 < 0 and tail:
            break
        tail.append(n)
        budget -= len(n) + 1
    return ";".join([head, "…", *reversed(tail)])
