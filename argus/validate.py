"""Strict checks for values decoded from untrusted msgpack (stream entries, registry records).

Each checker returns its value or raises `WireError` (a `BadData`) with a short `reason` that
readers count: ``type`` (wrong type; ``bool`` is not an int, floats are not ints), ``range``
(outside the sane range given), ``size`` (a string, array or map larger than its cap).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

from argus.errors import BadData

MAX_STR = 256  # job, host, op, phase, call, ... names
MAX_MAP = 8192  # entries in any map (kernels, phases, ...)

I64 = (-(1 << 63), (1 << 63) - 1)
U64 = (0, (1 << 64) - 1)
NONNEG = (0, (1 << 63) - 1)
RANK = (-1, (1 << 31) - 1)
PID = (0, (1 << 31) - 1)
REALTIME = (946_684_800 * 10**9, 4_102_444_800 * 10**9)  # 2000-01-01 .. 2100-01-01 in ns
U32 = (0, (1 << 32) - 1)
_INT = frozenset({int})


class WireError(BadData):
    """A stream entry that is not a valid summary; `reason` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"bad summary ({reason}): {detail}", "the writer is not a compatible argus agent")
        self.reason = reason


def as_int(v: Any, what: str, rng: Tuple[int, int] = I64) -> int:
    if type(v) is not int:
        raise WireError("type", f"{what}: {type(v).__name__}, not int")
    if not rng[0] <= v <= rng[1]:
        raise WireError("range", f"{what}: {v} outside [{rng[0]}, {rng[1]}]")
    return v


def opt_int(v: Any, what: str, rng: Tuple[int, int] = I64) -> Optional[int]:
    return None if v is None else as_int(v, what, rng)


def as_str(v: Any, what: str, cap: int = MAX_STR) -> str:
    if type(v) is not str:
        raise WireError("type", f"{what}: {type(v).__name__}, not str")
    if len(v) > cap:
        raise WireError("size", f"{what}: {len(v)} characters > {cap}")
    return v


def as_list(v: Any, what: str, cap: int) -> List[Any]:
    if type(v) is not list:
        raise WireError("type", f"{what}: {type(v).__name__}, not an array")
    if len(v) > cap:
        raise WireError("size", f"{what}: {len(v)} elements > {cap}")
    return v


def as_ints(v: Any, what: str, cap: int, rng: Tuple[int, int] = I64) -> List[int]:
    lst = as_list(v, what, cap)
    if lst:
        if not set(map(type, lst)) <= _INT:
            raise WireError("type", f"{what}: not all ints")
        if min(lst) < rng[0] or max(lst) > rng[1]:
            raise WireError("range", f"{what}: values outside [{rng[0]}, {rng[1]}]")
    return lst


def as_map(v: Any, what: str, cap: int = MAX_MAP) -> Dict[Any, Any]:
    if type(v) is not dict:
        raise WireError("type", f"{what}: {type(v).__name__}, not a map")
    if len(v) > cap:
        raise WireError("size", f"{what}: {len(v)} entries > {cap}")
    return v


def str_int_map(v: Any, what: str, rng: Tuple[int, int] = I64) -> Dict[str, int]:
    m = as_map(v, what)
    for k, x in m.items():
        as_str(k, f"{what} key")
        as_int(x, f"{what}[{k}]", rng)
    return m


def str_num_map(v: Any, what: str, cap: int, limit: float) -> Dict[str, float]:
    """A small map of names to finite numbers (ints or floats) of magnitude at most `limit`."""
    m = as_map(v, what, cap)
    out: Dict[str, float] = {}
    for k, x in m.items():
        as_str(k, f"{what} key", 32)
        if type(x) not in (int, float):
            raise WireError("type", f"{what}[{k}]: {type(x).__name__}, not a number")
        if not -limit <= x <= limit:  # also rejects NaN
            raise WireError("range", f"{what}[{k}]: {x} outside [-{limit:g}, {limit:g}]")
        out[k] = float(x)
    return out


MAX_KEY = 8  # wire keys are short strings; anything else is not what an encoder wrote


def known_keys(d: Dict[Any, Any], allowed: Set[str], what: str, ignored: Optional[Set[str]] = None) -> None:
    """Keys outside `allowed` are a newer writer's additions: skipped (named in `ignored` as
    ``what:key``) so that readers keep working while agents are upgraded first. A field that an
    older reader must not skip comes with a new schema version instead (docs/schema.md)."""
    for k in d.keys() - allowed:
        if type(k) is not str or not 0 < len(k) <= MAX_KEY:
            raise WireError("type", f"{what}: key {k!r:.40} is not a short string")
        if ignored is not None:
            ignored.add(f"{what}:{k}")
