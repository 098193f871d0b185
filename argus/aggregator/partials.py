"""What a shard aggregator tells the reducer (argus.aggregator.sharded): compact, per step.

A shard judges its ranks (L2, L3, host stalls, missing hosts) and publishes those alerts itself;
what needs the whole job goes to the reducer on ``argus:{JOB}:reduce``:

* per judged step (`StepPartial`): every rank's step time and collective count (the job's step
  time is their median over *all* ranks: L1, argus.aggregator.steptime), whether something the
  shard judged explains a slower step (an L1 finding is folded into it), whether the job's steps
  count from the communicators' creation (its warm-up), and the step's GPU-arrival evidence record
  (what an unexplained slowdown says about it). 8 + 8 bytes a rank: ~1.6 MB/s at 100,000 ranks
  and one step per second, beside ~60 MB/s of summaries;
* per heartbeat round (`HangPartial`): the shard's hang candidate on its own ranks; the reducer
  picks the one that names who the others wait for (a cut communicator's other part sees everyone
  blocked and nobody behind).

Read back strictly: anything malformed is a ValueError (the caller counts and drops it).
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import msgpack

from argus.aggregator.alerts import Finding
from argus.aggregator.gpuarrival import StepEvidence
from argus.aggregator.robust import quantile_sorted

MAX_PARTIAL = 64 << 20
EVIDENCE_FIELDS = [f.name for f in dataclasses.fields(StepEvidence) if f.name != "last"]


@dataclass
class GroupPart:
    """One shard's part of a symmetric group cut across shards, in one step: what L3's group-shift
    judgement (argus.aggregator.distributions) needs of it. The reducer judges the whole group: a
    part without the straggler would see its members' communication grow with nobody to blame."""

    key: str
    members: List[int]
    quiet: bool  # none of its members is named or a candidate in this step
    roles: Dict[str, str]  # phase -> role
    values: Dict[str, List[float]]  # phase -> its values (or least, 32 quantiles, most)
    host_wait: float  # the part's median host wait
    op: Optional[str] = None  # the communicator's main operation (for the alert's words)
    identity: Dict[str, Any] = field(default_factory=dict)

    def to_list(self) -> List[Any]:
        return [
            self.key,
            self.members,
            self.quiet,
            self.roles,
            self.values,
            self.host_wait,
            self.op,
            self.identity,
        ]


@dataclass
class StepPartial:
    job: str
    shard: int
    step: int
    t_ns: int  # the newest step end among the shard's ranks
    durations: List[int]  # ns, one per rank judged
    colls: List[int]  # collective instances (and p2p ops) per rank, same order
    explained: bool  # a specific finding in this step, or one still firing in the shard
    absolute: bool  # the job's steps count from the communicators' creation
    evidence: List[StepEvidence] = field(default_factory=list)
    groups: List[GroupPart] = field(default_factory=list)
    hosts: Dict[int, str] = field(default_factory=dict)  # ranks this shard had not told of yet

    def to_bytes(self) -> bytes:
        ev = [[getattr(e, k) for k in EVIDENCE_FIELDS] for e in self.evidence]
        return msgpack.packb(
            {
                "k": "s",
                "j": self.job,
                "sh": self.shard,
                "s": self.step,
                "t": self.t_ns,
                "d": array("q", self.durations).tobytes(),
                "c": array("q", self.colls).tobytes(),
                "x": self.explained,
                "a": self.absolute,
                "e": ev,
                "g": [g.to_list() for g in self.groups],
                "h": self.hosts,
            }
        )


@dataclass
class HangPartial:
    job: str
    shard: int
    ts_ns: int
    finding: Optional[Finding]
    hosts: Dict[int, str] = field(default_factory=dict)  # the finding's ranks -> host
    named: bool = False  # it names who the blocked ranks wait for (else: its blocked ranks)

    def to_bytes(self) -> bytes:
        f = None if self.finding is None else dataclasses.asdict(self.finding)
        d = {"k": "h", "j": self.job, "sh": self.shard, "t": self.ts_ns, "f": f, "h": self.hosts}
        return msgpack.packb({**d, "n": self.named})


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{what} is not an integer")
    return x


def _ints(b: Any, what: str) -> List[int]:
    if not isinstance(b, bytes) or len(b) % 8:
        raise ValueError(f"{what} is not packed int64s")
    return array("q", b).tolist()


def summarize(values: List[float]) -> List[float]:
    """A part's values of one phase, bounded: all of them up to 34, else the least (the group's
    level is the least over the whole group: exact), 32 quantiles (for the evidence) and the most."""
    vals = sorted(values)
    if len(vals) <= 34:
        return vals
    return [vals[0], *(quantile_sorted(vals, (i + 0.5) / 32) for i in range(32)), vals[-1]]


def decode(data: Any) -> Any:
    """A StepPartial or a HangPartial from its bytes; ValueError when malformed."""
    if not isinstance(data, bytes) or len(data) > MAX_PARTIAL:
        raise ValueError("not a partial")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as e:  # msgpack's errors have no common base
        raise ValueError(f"not msgpack: {type(e).__name__}") from None
    try:
        return _decode(d)
    except (TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"malformed partial: {type(e).__name__}: {e}"[:200]) from None


def _decode(d: Any) -> Any:
    if not isinstance(d, dict) or not isinstance(d.get("j"), str):
        raise ValueError("not a partial")
    job, shard = d["j"], _int(d.get("sh"), "shard")
    if d.get("k") == "s":
        durations, colls = _ints(d.get("d"), "durations"), _ints(d.get("c"), "colls")
        if len(durations) != len(colls):
            raise ValueError("durations and colls differ in length")
        ev = []
        for row in d.get("e") or []:
            if not isinstance(row, list) or len(row) != len(EVIDENCE_FIELDS):
                raise ValueError("malformed evidence")
            try:
                ev.append(StepEvidence(**dict(zip(EVIDENCE_FIELDS, row))))
            except TypeError as e:
                raise ValueError(f"malformed evidence: {e}") from None
        groups = []
        for row in d.get("g") or []:
            if not isinstance(row, list) or len(row) != 8:
                raise ValueError("malformed group part")
            key, members, quiet, roles, values, hw, op, ident = row
            if not isinstance(key, str) or not isinstance(members, list) or not isinstance(values, dict):
                raise ValueError("malformed group part")
            if not isinstance(roles, dict) or not isinstance(ident, dict):
                raise ValueError("malformed group part")
            groups.append(
                GroupPart(
                    key,
                    [_int(r, "rank") for r in members],
                    bool(quiet),
                    {str(p): str(v) for p, v in roles.items()},
                    {str(p): [float(x) for x in v] for p, v in values.items()},
                    float(hw),
                    op if isinstance(op, str) else None,
                    ident,
                )
            )
        hosts = d.get("h") or {}
        if not isinstance(hosts, dict):
            raise ValueError("malformed hosts")
        return StepPartial(
            job,
            shard,
            _int(d.get("s"), "step"),
            _int(d.get("t"), "t_ns"),
            durations,
            colls,
            bool(d.get("x")),
            bool(d.get("a")),
            ev,
            groups,
            {_int(r, "rank"): str(h) for r, h in hosts.items()},
        )
    if d.get("k") == "h":
        f = d.get("f")
        finding = None
        if f is not None:
            if not isinstance(f, dict) or not isinstance(f.get("ranks"), list):
                raise ValueError("malformed finding")
            known = {k: f[k] for k in Finding.__dataclass_fields__ if k in f}
            try:
                finding = Finding(**known)
                finding.steps = (int(finding.steps[0]), int(finding.steps[1]))
            except (TypeError, ValueError, IndexError) as e:
                raise ValueError(f"malformed finding: {e}") from None
        hosts = d.get("h") or {}
        if not isinstance(hosts, dict):
            raise ValueError("malformed hosts")
        hosts = {_int(r, "rank"): str(h) for r, h in hosts.items()}
        return HangPartial(job, shard, _int(d.get("t"), "ts"), finding, hosts, bool(d.get("n")))
    raise ValueError("unknown partial kind")
