"""Fault injection specs for the simulated job: parsing, validation and ground truth.

A spec is `KIND:key=value,key=value`, e.g. `straggler:rank=3,factor=1.5,from_step=10`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

KINDS: Dict[str, str] = {
    "straggler": "rank=R,factor=F[,from_step=S]  every kernel of rank R takes F times longer",
    "slow_link": "ranks=A-B,factor=F[,from_step=S]  the link between ranks A and B is F times slower",
    "host_stall": "rank=R,step=S,seconds=T  JIT-like CPU-bound compilation blocks the host",
    "dataloader_stall": "rank=R,step=S,seconds=T[,steps=N]  the data loader blocks T s (for N steps)",
    "gc_pause": "rank=R,step=S,seconds=T  a full garbage collection of about T s",
    "hang": "rank=R,step=S | rank=R,collective=N  the rank stops before a DP collective, forever",
    "bubble": "rank=R,factor=F[,from_step=S]  pipeline-bubble amplification: backward F times slower (pp-dp)",
    "masked_straggler": "rank=R,factor=F[,from_step=S]  only MLP kernels slower; peers' collectives wait",
}


@dataclass
class Fault:
    kind: str
    rank: int = -1
    ranks: Tuple[int, ...] = ()
    factor: float = 1.0
    from_step: int = 0
    step: int = -1
    seconds: float = 0.0
    steps: int = 1
    collective: int = -1
    spec: str = ""
    extra: Dict[str, str] = field(default_factory=dict)

    def applies(self, rank: int) -> bool:
        return rank == self.rank or rank in self.ranks

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = list(self.ranks) if self.ranks else ([self.rank] if self.rank >= 0 else [])
        return d


class FaultSpecError(ValueError):
    pass


def parse(spec: str, world: int, steps: Optional[int] = None) -> Fault:
    """Parse one `--inject` spec; raise FaultSpecError with a readable reason."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip().replace("-", "_")
    if kind not in KINDS:
        raise FaultSpecError(f"unknown fault kind '{kind}' (known: {', '.join(KINDS)})")
    kv: Dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        if not eq:
            raise FaultSpecError(f"'{part}' in '{spec}' is not key=value")
        kv[k.strip()] = v.strip()
    f = Fault(kind=kind, spec=spec)
    try:
        if "rank" in kv:
            f.rank = int(kv.pop("rank"))
        if "ranks" in kv:
            a, _, b = kv.pop("ranks").partition("-")
            f.ranks = (int(a), int(b))
        if "factor" in kv:
            f.factor = float(kv.pop("factor"))
        if "from_step" in kv:
            f.from_step = int(kv.pop("from_step"))
        if "step" in kv:
            f.step = int(kv.pop("step"))
        if "seconds" in kv:
            f.seconds = float(kv.pop("seconds"))
        if "steps" in kv:
            f.steps = int(kv.pop("steps"))
        if "collective" in kv:
            f.collective = int(kv.pop("collective"))
    except ValueError as e:
        raise FaultSpecError(f"bad number in '{spec}': {e}") from None
    if kv:
        raise FaultSpecError(f"unknown key(s) {', '.join(kv)} for {kind} (usage: {kind}:{KINDS[kind]})")
    need_rank = kind != "slow_link"
    if need_rank and not 0 <= f.rank < world:
        raise FaultSpecError(f"{kind} needs rank=R with 0 <= R < {world} (usage: {kind}:{KINDS[kind]})")
    if kind == "slow_link":
        if len(f.ranks) != 2 or not all(0 <= r < world for r in f.ranks) or f.ranks[0] == f.ranks[1]:
            raise FaultSpecError(f"slow_link needs ranks=A-B, two distinct ranks < {world}")
    if kind in ("straggler", "slow_link", "bubble", "masked_straggler") and f.factor <= 0:
        raise FaultSpecError(f"{kind} needs factor > 0")
    if kind in ("host_stall", "dataloader_stall", "gc_pause"):
        if f.step < 0 or f.seconds <= 0:
            raise FaultSpecError(f"{kind} needs step=S and seconds=T > 0 (usage: {kind}:{KINDS[kind]})")
    if kind == "hang" and f.step < 0 and f.collective < 0:
        raise FaultSpecError("hang needs step=S or collective=N")
    if steps is not None:
        onset = f.step if f.step >= 0 else f.from_step
        if onset >= steps:
            raise FaultSpecError(f"{kind} starts at step {onset} but the run has only {steps} steps")
    return f


def parse_all(specs: List[str], world: int, steps: Optional[int] = None) -> List[Fault]:
    return [parse(s, world, steps) for s in specs]


def from_dicts(items: List[dict]) -> List[Fault]:
    out = []
    for d in items:
        d = dict(d)
        d["ranks"] = tuple(d.get("ranks") or ())
        if d["kind"] != "slow_link":
            d["ranks"] = ()
        out.append(Fault(**d))
    return out
