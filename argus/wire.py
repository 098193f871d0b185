"""The compact msgpack form of RankStep and Heartbeat, and its strict decoder (docs/schema.md).

`encode_step` / `encode_heartbeat` turn the decoded contract (argus.schema) into a few hundred
bytes to a couple of KB; `decode_step` / `decode_heartbeat` rebuild it and reject anything that is
not exactly what an encoder of a supported schema version writes: wrong types, oversized strings,
arrays or entries, out-of-range numbers, keys that are not short strings, truncated or trailing
bytes. Every rejection is a `WireError` (a `BadData`) carrying a short `reason` that readers count.
Short string keys this version does not know are skipped and named in `ignored`: a newer agent's
optional fields (readers are upgraded after agents; a field that must not be skipped bumps the
schema version instead). msgpack only: no pickle, no eval, no extension types.

What is quantised (everything else round-trips exactly):

* collective / p2p arrival times: µs offsets from the step start, delta-encoded per communicator
  (absolute error ≤ 500 ns, no accumulation: the offsets are rounded before the deltas are taken);
* per-instance host time of a collective or p2p call: ``round(16·log2 ns)`` (relative error
  ≤ 2**(1/32) − 1 ≈ 2.2 %; values below 1 ns decode as 1 ns);

Retired keys (``hc``, host-time KDE clusters per op; ``la``, launch-call latency clusters) are
accepted from older agents and dropped: nothing read them.

Kernel names are interned as their CRC-32 (`name_id`); the id → name table lives in the
``argus:{JOB}:names`` hash (argus.transport writes it before the first entry that uses an id).
A name whose id collides with another name is sent inline instead.
"""

from __future__ import annotations

import math
import zlib
from itertools import accumulate
from typing import Any, Collection, Dict, List, Mapping, Optional, Set

import msgpack

from argus.schema import OPS, P2P, CommStep, GpuArrival, Heartbeat, InFlight, P2POp, RankStep
from argus.validate import (
    MAX_MAP,
    NONNEG,
    PID,
    RANK,
    REALTIME,
    U32,
    U64,
    WireError,
    as_int,
    as_ints,
    as_list,
    as_map,
    as_str,
    known_keys,
    opt_int,
    str_int_map,
    str_num_map,
)

SUPPORTED_VERSIONS = frozenset({1})
MAX_ENTRY_BYTES = 256 * 1024  # hard cap of one encoded entry (the budget is 2.7 KB)
MAX_NAME = 4096  # kernel names (mangled C++ templates are long)
MAX_COMMS = 512
MAX_INSTANCES = 65536  # collectives (or p2p calls) per communicator per step
MAX_GPU_KEYS = 32
HOST_SCALE = 16  # per-instance host time: round(16·log2 ns)
HOST_REL_ERROR = 2.0 ** (1.0 / (2 * HOST_SCALE)) - 1.0
ARRIVAL_ABS_ERROR_NS = 500
IDENTITIES = ("table", "init", "split", "accessors", "inferred", "attach", "handle")
# `i` carries what a reader of before the late-attach alignment knows (it rejects other values);
# the identity itself then goes in `ix`, which such a reader skips (and says so)
LEGACY_IDENTITY = {"table": "attach", "accessors": "handle", "inferred": "handle"}
# sane ranges

# RankStep / CommStep / Heartbeat field -> wire key (tests/test_wire.py fails when a field is missing)
STEP_FIELDS = {
    "job": "j", "rank": "r", "host": "h", "pid": "p", "step": "s", "start_ns": "t0", "duration_ns": "dt",
    "local_rank": "lr", "world_size": "w", "step_source": "ss", "clock_offset_ns": "co",
    "clock_uncertainty_ns": "cu", "sync_count": "sc", "sync_wait_ns": "sw", "phases": "ph",
    "phase_stream": "ps", "py_phases": "pp", "launches": "l", "launches_sampled": "lu",
    "launch_wait_ns": "lw", "kernels": "k/kx",
    "memcpy": "mc", "errors": "e", "comms": "c", "drops": "dr", "version": "v",
    "gpu": "g", "gpu_arrival": "ga",
    "detail": "",  # not on the wire: what only `argus probe --json` prints (argus.schema.ProbeDetail)
}  # fmt: skip
COMM_FIELDS = {
    "comm": "id", "nranks": "n", "rank": "r", "identity": "i", "seqs": "s0/sd", "ops": "op", "nbytes": "b",
    "arrive_ns": "a", "host_ns": "hb/hq", "p2p": "p", "first_seq": "f", "count": "k",
}  # fmt: skip
HEARTBEAT_FIELDS = {
    "job": "j", "agent": "a", "host": "h", "ts_ns": "ts", "ranks": "rk", "inflight": "if", "last_seq": "ls",
    "last_step": "st", "drops": "dr", "version": "v", "health": "hl", "where": "wh", "attach_blocked": "ab",
    "inflight_comm": "ic",
}  # fmt: skip

__all__ = [
    "HOST_REL_ERROR",
    "MAX_ENTRY_BYTES",
    "SUPPORTED_VERSIONS",
    "WireError",
    "decode_heartbeat",
    "decode_step",
    "encode_heartbeat",
    "encode_step",
    "host_q",
    "host_unq",
    "name_id",
    "step_names",
]


def name_id(name: str) -> int:
    """The interned id of a kernel name: CRC-32 of its UTF-8 bytes."""
    return zlib.crc32(name.encode("utf-8", "surrogatepass"))


def host_q(ns: int) -> int:
    return round(HOST_SCALE * math.log2(ns)) if ns > 1 else 0


_HOST_TABLE = [round(2.0 ** (q / HOST_SCALE)) for q in range(2048)]


def host_unq(q: int) -> int:
    return _HOST_TABLE[q] if 0 <= q < 2048 else round(2.0 ** (q / HOST_SCALE))


def _op_code(op: str) -> Any:
    try:
        return OPS.index(op)
    except ValueError:
        return op


def _rle(values: List[Any]) -> List[Any]:
    out: List[Any] = []
    for v in values:
        if out and out[-2] == v:
            out[-1] += 1
        else:
            out += [v, 1]
    return out


def _us_deltas(times: List[int], t0: int) -> List[int]:
    offs = [(t - t0 + 500) // 1000 for t in times]  # round half up, also for negative offsets
    return [b - a for a, b in zip([0, *offs], offs)]


# --------------------------------------------------------------------------------------------------
# encoding


def step_names(rs: RankStep, inline: Collection[str] = ()) -> Dict[int, str]:
    """The interned names `encode_step(rs, inline)` refers to (id -> name)."""
    out: Dict[int, str] = {}
    for name in rs.kernels:
        if name in inline:
            continue
        i = name_id(name)
        if i not in out:
            out[i] = name
    return out


def _enc_comm(c: CommStep, t0: int) -> Dict[str, Any]:
    n = len(c.seqs)
    if not (len(c.ops) == len(c.nbytes) == len(c.arrive_ns) == len(c.host_ns) == n):
        raise ValueError(f"communicator {c.comm}: per-instance lists differ in length")
    d: Dict[str, Any] = {"id": int(c.comm, 16), "n": c.nranks, "r": c.rank}
    d["i"] = LEGACY_IDENTITY.get(c.identity, c.identity)
    if c.identity in LEGACY_IDENTITY:
        d["ix"] = c.identity
    if n:
        d["s0"] = c.seqs[0]
        gaps = [b - a for a, b in zip(c.seqs, c.seqs[1:])]
        if any(g != 1 for g in gaps):
            d["sd"] = gaps
        d["op"] = _rle([_op_code(o) for o in c.ops])
        d["b"] = _rle(list(c.nbytes))
        d["a"] = _us_deltas(c.arrive_ns, t0)
        qs = [host_q(h) for h in c.host_ns]
        base = min(qs)
        d["hb"] = base
        d["hq"] = [q - base for q in qs]
    if c.count:
        d["f"], d["k"] = c.first_seq, c.count
    if c.p2p:
        arr = _us_deltas([p.arrive_ns for p in c.p2p], t0)
        d["p"] = [[_op_code(p.op), p.peer, p.nbytes, a, host_q(p.host_ns)] for p, a in zip(c.p2p, arr)]
    return d


def encode_step(rs: RankStep, inline: Collection[str] = ()) -> bytes:
    """`rs` as msgpack bytes. Kernel names are interned (see `step_names`) except those in `inline`
    and those whose id collides with another name of this step."""
    t0 = rs.start_ns
    d: Dict[str, Any] = {
        "v": rs.version,
        "j": rs.job,
        "r": rs.rank,
        "h": rs.host,
        "p": rs.pid,
        "s": rs.step,
        "t0": t0,
        "dt": rs.duration_ns,
        "ss": rs.step_source,
    }
    for key, val, default in (
        ("lr", rs.local_rank, -1),
        ("w", rs.world_size, -1),
        ("co", rs.clock_offset_ns, 0),
        ("cu", rs.clock_uncertainty_ns, 0),
        ("sc", rs.sync_count, 0),
        ("sw", rs.sync_wait_ns, 0),
        ("l", rs.launches, 0),
        ("lw", rs.launch_wait_ns, 0),
    ):
        if val != default:
            d[key] = val
    if not rs.launches_sampled:
        d["lu"] = 1  # launches unsampled (absent: sampled)
    if rs.phases:
        d["ph"] = rs.phases
    if rs.phase_stream:
        d["ps"] = rs.phase_stream
    if rs.py_phases:
        d["pp"] = rs.py_phases
    ids: List[int] = []
    seen: Dict[int, str] = {}
    extra: Dict[str, int] = {}
    for name, count in rs.kernels.items():
        i = name_id(name)
        if name in inline or seen.get(i, name) != name:
            extra[name] = count
            continue
        seen[i] = name
        ids += [i, count]
    if ids:
        d["k"] = ids
    if extra:
        d["kx"] = extra
    if rs.memcpy:
        d["mc"] = {k: [c, b] for k, (c, b) in rs.memcpy.items()}
    if rs.errors:
        d["e"] = rs.errors
    if rs.comms:
        d["c"] = [_enc_comm(c, t0) for c in rs.comms.values()]
    if rs.drops:
        d["dr"] = rs.drops
    if rs.gpu:
        d["g"] = {k: int(v) if float(v).is_integer() else v for k, v in rs.gpu.items()}
    if rs.gpu_arrival is not None:
        d["ga"] = _enc_gpu_arrival(rs.gpu_arrival, t0)
    return msgpack.packb(d, use_bin_type=True)  # type: ignore[no-any-return]


def _rel_us(t: int, t0: int) -> int:
    return (t - t0 + 500) // 1000


def _enc_gpu_arrival(g: GpuArrival, t0: int) -> Dict[str, Any]:
    """Times as µs from the step's start (negative: the previous step's); an unknown upper bound as
    null."""
    d: Dict[str, Any] = {"s": g.step}
    if g.bounds:
        d["b"] = {
            c: [[i, _rel_us(lo, t0), _rel_us(hi, t0) if hi else None, src] for i, lo, hi, src in v]
            for c, v in g.bounds.items()
        }
    if g.net_first_ns:
        d["n"] = _rel_us(g.net_first_ns, t0)
    if g.coll_gpu_ns:
        d["t"] = g.coll_gpu_ns
    return d


def encode_heartbeat(hb: Heartbeat) -> bytes:
    d: Dict[str, Any] = {
        "v": hb.version,
        "hb": 1,
        "j": hb.job,
        "a": hb.agent,
        "h": hb.host,
        "ts": hb.ts_ns,
        "rk": hb.ranks,
        "if": [
            [f.rank, f.pid, f.call, f.since_ns, None if f.comm is None else int(f.comm, 16), f.seq]
            for f in hb.inflight
        ],
        "ls": {r: [x for c, s in m.items() for x in (int(c, 16), s)] for r, m in hb.last_seq.items()},
        "st": hb.last_step,
    }
    if hb.drops:
        d["dr"] = hb.drops
    if hb.health:
        d["hl"] = hb.health
    if hb.where:
        d["wh"] = {r: w[:MAX_WHERE] for r, w in hb.where.items()}
    if hb.attach_blocked:
        d["ab"] = hb.attach_blocked
    if hb.inflight_comm:
        d["ic"] = hb.inflight_comm
    return msgpack.packb(d, use_bin_type=True)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------------
# strict decoding


def _unpack(data: Any) -> Dict[Any, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("type", f"entry is {type(data).__name__}, not bytes")
    if len(data) > MAX_ENTRY_BYTES:
        raise WireError("size", f"{len(data)} bytes > {MAX_ENTRY_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as e:  # msgpack raises many kinds (ExtraData, FormatError, StackError, ...)
        raise WireError("msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    if type(obj) is not dict:
        raise WireError("type", f"top level is {type(obj).__name__}, not a map")
    v = obj.get("v")
    if type(v) is not int or v not in SUPPORTED_VERSIONS:
        raise WireError("version", f"schema version {v!r} (supported: {sorted(SUPPORTED_VERSIONS)})")
    return obj


def _op(v: Any, what: str) -> str:
    if type(v) is int:
        if not 0 <= v < len(OPS):
            raise WireError("range", f"{what}: op code {v}")
        return OPS[v]
    return as_str(v, what)


def _unrle(v: Any, what: str, n: int, conv: Any) -> List[Any]:
    lst = as_list(v, what, 2 * MAX_INSTANCES)
    if len(lst) % 2:
        raise WireError("type", f"{what}: odd run-length array")
    out: List[Any] = []
    for i in range(0, len(lst), 2):
        run = as_int(lst[i + 1], f"{what} run", (1, MAX_INSTANCES))
        if len(out) + run > n:
            raise WireError("range", f"{what}: runs exceed {n} instances")
        out += [conv(lst[i], what)] * run
    if len(out) != n:
        raise WireError("range", f"{what}: runs cover {len(out)} of {n} instances")
    return out


_COMM_KEYS = {"id", "n", "r", "i", "ix", "s0", "sd", "op", "b", "a", "hb", "hq", "p", "hc", "f", "k"}


def _dec_comm(d: Any, t0: int, ignored: Optional[Set[str]]) -> CommStep:
    d = as_map(d, "comm", 32)
    known_keys(d, _COMM_KEYS, "comm", ignored)
    cid = f"{as_int(d.get('id'), 'comm id', U64):016x}"
    ident = as_str(d.get("ix", d.get("i")), "comm identity")
    if ident not in IDENTITIES:
        raise WireError("range", f"comm identity {ident!r}")
    c = CommStep(cid, as_int(d.get("n"), "nranks", RANK), as_int(d.get("r"), "comm rank", RANK), ident)
    arr = d.get("a")
    if arr is not None:
        deltas = as_ints(arr, "arrivals", MAX_INSTANCES, (-(1 << 44), 1 << 44))
        n = len(deltas)
        s0 = as_int(d.get("s0"), "first seq", NONNEG)
        gaps = d.get("sd")
        gap_list = [1] * (n - 1) if gaps is None else as_ints(gaps, "seq gaps", n, (-(1 << 62), 1 << 62))
        if len(gap_list) != max(0, n - 1):
            raise WireError("range", "seq gaps do not match the arrivals")
        c.seqs = list(accumulate(gap_list, initial=s0)) if n else []
        c.ops = _unrle(d.get("op"), "ops", n, _op)
        c.nbytes = _unrle(d.get("b"), "bytes", n, lambda x, w: as_int(x, w, NONNEG))
        c.arrive_ns = [t0 + 1000 * x for x in accumulate(deltas)]
        base = as_int(d.get("hb"), "host base", (0, 2048))
        hq = as_ints(d.get("hq"), "host times", n, (0, 2048))
        if len(hq) != n:
            raise WireError("range", "host times do not match the arrivals")
        c.host_ns = [host_unq(base + q) for q in hq]
    elif any(k in d for k in ("s0", "sd", "op", "b", "hb", "hq")):
        raise WireError("type", "per-instance fields without arrivals")
    if "k" in d:
        c.count = as_int(d.get("k"), "collectives", (len(c.seqs), MAX_INSTANCES))
        c.first_seq = as_int(d.get("f"), "first seq", NONNEG)
        if c.seqs and not c.first_seq <= c.seqs[0] <= c.seqs[-1] < c.first_seq + c.count:
            raise WireError("range", "sampled instances outside the step's collectives")
    p2p = d.get("p")
    if p2p is not None:
        prev = 0
        for p in as_list(p2p, "p2p", MAX_INSTANCES):
            p = as_list(p, "p2p op", 5)
            if len(p) != 5:
                raise WireError("type", "p2p op is not [op, peer, bytes, arrival, host]")
            op = _op(p[0], "p2p op")
            if op not in P2P:
                raise WireError("range", f"p2p op {op!r}")
            prev += as_int(p[3], "p2p arrival", (-(1 << 44), 1 << 44))
            c.p2p.append(
                P2POp(
                    op,
                    as_int(p[1], "peer", RANK),
                    as_int(p[2], "p2p bytes", NONNEG),
                    t0 + 1000 * prev,
                    host_unq(as_int(p[4], "p2p host", (0, 2048))),
                )
            )
    return c


_STEP_KEYS = {
    "v", "j", "r", "h", "p", "s", "t0", "dt", "ss", "lr", "w", "co", "cu", "sc", "sw", "ph", "ps", "pp", "l",
    "lu", "lw", "k", "kx", "la", "mc", "e", "c", "dr", "g", "ga",
}  # fmt: skip


def decode_step(
    data: Any,
    names: Optional[Mapping[int, str]] = None,
    missing: Optional[Set[int]] = None,
    ignored: Optional[Set[str]] = None,
) -> RankStep:
    """Validate and rebuild a RankStep. Interned kernel ids absent from `names` decode as
    ``#xxxxxxxx`` and are added to `missing` (a reader fetches them and decodes again); keys of a
    newer schema are skipped and added to `ignored`."""
    d = _unpack(data)
    if "hb" in d:
        raise WireError("kind", "a heartbeat, not a step")
    try:
        return _dec_step(d, names or {}, missing, ignored)
    except WireError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError) as e:  # belt and braces
        raise WireError("invalid", f"{type(e).__name__}: {e}"[:200]) from None


def _dec_step(
    d: Dict[Any, Any], names: Mapping[int, str], missing: Optional[Set[int]], ignored: Optional[Set[str]]
) -> RankStep:
    known_keys(d, _STEP_KEYS, "step", ignored)
    t0 = as_int(d.get("t0"), "start_ns", REALTIME)
    rs = RankStep(
        job=as_str(d.get("j"), "job"),
        rank=as_int(d.get("r"), "rank", RANK),
        host=as_str(d.get("h"), "host"),
        pid=as_int(d.get("p"), "pid", PID),
        step=opt_int(d.get("s"), "step", NONNEG),
        start_ns=t0,
        duration_ns=as_int(d.get("dt"), "duration_ns", NONNEG),
        local_rank=as_int(d.get("lr", -1), "local_rank", RANK),
        world_size=as_int(d.get("w", -1), "world_size", RANK),
        step_source=as_str(d.get("ss"), "step_source"),
        clock_offset_ns=as_int(d.get("co", 0), "clock offset"),
        clock_uncertainty_ns=as_int(d.get("cu", 0), "clock uncertainty", NONNEG),
        sync_count=as_int(d.get("sc", 0), "sync_count", NONNEG),
        sync_wait_ns=as_int(d.get("sw", 0), "sync_wait_ns", NONNEG),
        launches=as_int(d.get("l", 0), "launches", NONNEG),
        launches_sampled=not as_int(d.get("lu", 0), "launches unsampled flag", (0, 1)),
        launch_wait_ns=as_int(d.get("lw", 0), "launch_wait_ns", NONNEG),
        version=d["v"],
    )
    if "ph" in d:
        rs.phases = str_int_map(d["ph"], "phases")
    if "ps" in d:
        rs.phase_stream = str_int_map(d["ps"], "phase streams", (0, 1 << 16))
    if "pp" in d:
        rs.py_phases = str_int_map(d["pp"], "python phases", NONNEG)
    if "k" in d:
        ids = as_ints(d["k"], "kernels", 2 * MAX_MAP, NONNEG)
        if len(ids) % 2:
            raise WireError("type", "kernels: odd array")
        for i in range(0, len(ids), 2):
            kid = ids[i]
            if kid > U32[1]:
                raise WireError("range", f"kernel id {kid}")
            name = names.get(kid)
            if name is None:
                name = f"#{kid:08x}"
                if missing is not None:
                    missing.add(kid)
            rs.kernels[name] = ids[i + 1]
    if "kx" in d:
        for name, count in as_map(d["kx"], "inline kernels").items():
            rs.kernels[as_str(name, "kernel name", MAX_NAME)] = as_int(count, "kernel count", NONNEG)
    if "mc" in d:
        for kind, v in as_map(d["mc"], "memcpy", 64).items():
            cb = as_ints(v, "memcpy entry", 2, NONNEG)
            if len(cb) != 2:
                raise WireError("type", "memcpy entry is not [count, bytes]")
            rs.memcpy[as_str(kind, "memcpy kind")] = (cb[0], cb[1])
    if "e" in d:
        for call, codes in as_map(d["e"], "errors", 1024).items():
            m = as_map(codes, "error codes", 1024)
            rs.errors[as_str(call, "call")] = {
                as_int(k, "error code"): as_int(v, "error count", NONNEG) for k, v in m.items()
            }
    if "c" in d:
        for raw in as_list(d["c"], "comms", MAX_COMMS):
            c = _dec_comm(raw, t0, ignored)
            if c.comm in rs.comms:
                raise WireError("range", f"communicator {c.comm} twice")
            rs.comms[c.comm] = c
    if "dr" in d:
        rs.drops = str_int_map(d["dr"], "drops", NONNEG)
    if "g" in d:
        rs.gpu = str_num_map(d["g"], "gpu", MAX_GPU_KEYS, 1e15)
    if "ga" in d:
        rs.gpu_arrival = _dec_gpu_arrival(d["ga"], t0)
    return rs


_GA_KEYS = {"s", "b", "n", "t"}
REL_US = (-(10**12), 10**12)  # µs from the step's start: ±11 days


def _dec_gpu_arrival(v: Any, t0: int) -> GpuArrival:
    d = as_map(v, "gpu arrival", 8)
    known_keys(d, _GA_KEYS, "gpu arrival")
    g = GpuArrival(step=opt_int(d.get("s"), "gpu arrival step", NONNEG))
    for comm, rows in as_map(d.get("b", {}), "gpu arrival bounds", MAX_COMMS).items():
        out = []
        for row in as_list(rows, "gpu arrival bounds", MAX_INSTANCES):
            r = as_list(row, "gpu arrival bound", 4)
            if len(r) != 4:
                raise WireError("type", "gpu arrival bound is not [index, lo, hi, sources]")
            i = as_int(r[0], "gpu arrival index", (0, MAX_INSTANCES))
            lo = t0 + 1000 * as_int(r[1], "gpu arrival lower bound", REL_US)
            hi = 0 if r[2] is None else t0 + 1000 * as_int(r[2], "gpu arrival upper bound", REL_US)
            src = as_str(r[3], "gpu arrival sources", 4)
            out.append((i, lo, hi, src))
        g.bounds[as_str(comm, "communicator")] = out
    if "n" in d:
        g.net_first_ns = t0 + 1000 * as_int(d["n"], "first network send", REL_US)
    for comm, ts in as_map(d.get("t", {}), "collective GPU times", MAX_COMMS).items():
        g.coll_gpu_ns[as_str(comm, "communicator")] = as_ints(
            ts, "collective GPU times", MAX_INSTANCES, NONNEG
        )
    return g


MAX_WHERE = 300  # characters of one rank's "what it is doing" line
_HB_KEYS = {"hb", *HEARTBEAT_FIELDS.values()}


def decode_heartbeat(data: Any, ignored: Optional[Set[str]] = None) -> Heartbeat:
    d = _unpack(data)
    if d.get("hb") != 1:
        raise WireError("kind", "not a heartbeat")
    try:
        return _dec_hb(d, ignored)
    except WireError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError) as e:
        raise WireError("invalid", f"{type(e).__name__}: {e}"[:200]) from None


def _dec_hb(d: Dict[Any, Any], ignored: Optional[Set[str]]) -> Heartbeat:
    known_keys(d, _HB_KEYS, "heartbeat", ignored)
    hb = Heartbeat(
        job=as_str(d.get("j"), "job"),
        agent=as_str(d.get("a"), "agent"),
        host=as_str(d.get("h"), "host"),
        ts_ns=as_int(d.get("ts"), "ts_ns", REALTIME),
        version=d["v"],
    )
    for r, pid in as_map(d.get("rk"), "ranks").items():
        hb.ranks[as_int(r, "rank", RANK)] = as_int(pid, "pid", PID)
    for f in as_list(d.get("if"), "inflight", MAX_MAP):
        f = as_list(f, "inflight call", 6)
        if len(f) != 6:
            raise WireError("type", "inflight call is not [rank, pid, call, since, comm, seq]")
        comm = opt_int(f[4], "inflight comm", U64)
        hb.inflight.append(
            InFlight(
                as_int(f[0], "rank", RANK),
                as_int(f[1], "pid", PID),
                as_str(f[2], "call"),
                as_int(f[3], "since_ns", REALTIME),
                None if comm is None else f"{comm:016x}",
                opt_int(f[5], "seq", NONNEG),
            )
        )
    for r, flat in as_map(d.get("ls"), "last_seq").items():
        v = as_ints(flat, "last_seq entry", 2 * MAX_COMMS, U64)
        if len(v) % 2 or any(s > NONNEG[1] for s in v[1::2]):
            raise WireError("range", "last_seq entry is not (comm, seq) pairs")
        hb.last_seq[as_int(r, "rank", RANK)] = {f"{v[i]:016x}": v[i + 1] for i in range(0, len(v), 2)}
    for r, s in as_map(d.get("st"), "last_step").items():
        hb.last_step[as_int(r, "rank", RANK)] = as_int(s, "step", NONNEG)
    if "dr" in d:
        hb.drops = str_int_map(d["dr"], "drops", NONNEG)
    if "hl" in d:
        hb.health = str_int_map(d["hl"], "health")
    for r, w in as_map(d.get("wh", {}), "where").items():
        hb.where[as_int(r, "rank", RANK)] = as_str(w, "where", MAX_WHERE)
    hb.attach_blocked = [as_int(r, "rank", RANK) for r in as_list(d.get("ab", []), "attach_blocked", MAX_MAP)]
    for r, v in as_map(d.get("ic", {}), "inflight_comm").items():
        pair = as_ints(v, "inflight_comm entry", 2, RANK)
        if len(pair) != 2 or not 0 <= pair[1] < pair[0]:
            raise WireError("range", "inflight_comm entry is not [nranks, rank]")
        hb.inflight_comm[as_int(r, "rank", RANK)] = pair
    return hb
