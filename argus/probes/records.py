"""Python mirrors of argus/bpf/records.h and decoding of ring-buffer records.

Field order, widths and padding must match the C structs exactly; tests/test_layout.py compares
every mirror with the layout bcc compiled.
"""

from __future__ import annotations

import ctypes
import struct
from ctypes import c_char, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64
from typing import Any, Dict, Type, Union

REC_SYNC = 1
REC_FUNC_NAME = 2
REC_EVENT_RECORD = 3
REC_ELAPSED = 4
REC_NCCL = 5
REC_COMM_INIT = 6
REC_PY_MARK = 7
REC_PY_SAMPLE = 8
REC_OFFCPU = 9
REC_PY_CALL = 10
REC_CALL = 11
REC_GC = 12
REC_STREAM_WAIT = 13
REC_EVENT_DONE = 14
REC_NET_SEND = 15
PY_MAX_FRAMES = 96
PY_F_TRUNCATED = 1
PROF_ONCPU, PROF_OFFCPU = 0, 1
USDT_ARG_NONE, USDT_ARG_REG, USDT_ARG_MEM, USDT_ARG_CONST = 0, 1, 2, 3

DROP_RINGBUF, DROP_AGG, DROP_SCRATCH = 0, 1, 2
DROP_NAMES = {DROP_RINGBUF: "ringbuf", DROP_AGG: "aggregation map full", DROP_SCRATCH: "scratch map full"}
NCCL_F_IN_GROUP = 1


class S(ctypes.Structure):
    def as_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {}
        for name, _t in self._fields_:  # type: ignore[misc]
            v = getattr(self, name)
            out[name] = v.as_dict() if isinstance(v, S) else v
        return out


class TargetCfg(S):
    _fields_ = [
        ("rank", c_uint32),
        ("flags", c_uint32),
        ("off_comm_hash", c_uint32),
        ("off_comm_rank", c_uint32),
        ("off_comm_nranks", c_uint32),
    ]


class RecHdr(S):
    _fields_ = [
        ("kind", c_uint32),
        ("tgid", c_uint32),
        ("tid", c_uint32),
        ("call", c_uint32),
        ("ts", c_uint64),
        ("epoch", c_uint64),
    ]


class RecSync(S):
    _fields_ = [
        ("h", RecHdr),
        ("enter_ns", c_uint64),
        ("handle", c_uint64),
        ("result", c_int32),
        ("bytes_kind", c_uint32),
        ("bytes", c_uint64),
        ("pos", c_uint64),
    ]


class RecFuncName(S):
    _fields_ = [
        ("h", RecHdr),
        ("func", c_uint64),
        ("result", c_int32),
        ("pad", c_uint32),
        ("name", c_char * 128),
    ]


class RecEventRecord(S):
    _fields_ = [("h", RecHdr), ("event", c_uint64), ("stream", c_uint64), ("pos", c_uint64)]


class RecElapsed(S):
    _fields_ = [
        ("h", RecHdr),
        ("start_ev", c_uint64),
        ("end_ev", c_uint64),
        ("ms_bits", c_uint32),
        ("result", c_int32),
        ("start_stream", c_uint64),
        ("start_pos", c_uint64),
        ("start_ns", c_uint64),
        ("end_stream", c_uint64),
        ("end_pos", c_uint64),
        ("end_ns", c_uint64),
        ("end_epoch", c_uint64),
    ]


class RecNccl(S):
    _fields_ = [
        ("h", RecHdr),
        ("comm", c_uint64),
        ("seq", c_uint64),
        ("count", c_uint64),
        ("stream", c_uint64),
        ("enter_ns", c_uint64),
        ("dtype", c_uint32),
        ("peer", c_int32),
        ("redop", c_uint32),
        ("result", c_int32),
        ("flags", c_uint32),
        ("skipped", c_uint32),
        ("pos", c_uint64),
        ("skip_pos", c_uint64),
    ]


class RecCommInit(S):
    _fields_ = [
        ("h", RecHdr),
        ("comm", c_uint64),
        ("parent", c_uint64),
        ("comm_hash", c_uint64),
        ("nranks", c_int32),
        ("rank", c_int32),
        ("color", c_int32),
        ("key", c_int32),
        ("result", c_int32),
        ("comm_rank", c_int32),
        ("comm_nranks", c_int32),
        ("has_uid", c_uint32),
        ("uid", c_uint8 * 128),
    ]


class LaunchKey(S):
    _fields_ = [("tgid", c_uint32), ("pad", c_uint32), ("epoch", c_uint64), ("func", c_uint64)]


class HistKey(S):
    _fields_ = [("tgid", c_uint32), ("kind", c_uint16), ("slot", c_uint16), ("epoch", c_uint64)]


class MemKey(S):
    _fields_ = [("tgid", c_uint32), ("kind", c_uint32), ("epoch", c_uint64)]


class MemVal(S):
    _fields_ = [("count", c_uint64), ("bytes", c_uint64)]


class ErrKey(S):
    _fields_ = [("tgid", c_uint32), ("call", c_uint32), ("epoch", c_uint64), ("result", c_int64)]


class CallKey(S):
    _fields_ = [("tgid", c_uint32), ("call", c_uint32), ("epoch", c_uint64)]


class Inflight(S):
    _fields_ = [
        ("tgid", c_uint32),
        ("call", c_uint32),
        ("enter_ns", c_uint64),
        ("handle", c_uint64),
        ("seq", c_uint64),
    ]


class UsdtArg(S):
    _fields_ = [
        ("kind", c_uint8),
        ("reg", c_uint8),
        ("size", c_uint8),
        ("is_signed", c_uint8),
        ("offset", c_int32),
    ]


class PyCfg(S):
    _fields_ = [
        ("version", c_uint32),
        ("flags", c_uint32),
        ("off_tstate_frame", c_uint32),
        ("off_cframe_frame", c_uint32),
        ("off_frame_code", c_uint32),
        ("off_frame_back", c_uint32),
        ("off_frame_owner", c_uint32),
        ("pad", c_uint32),
        ("gc_start_gen", UsdtArg),
        ("gc_done_collected", UsdtArg),
    ]


class PyStack(S):
    _fields_ = [("depth", c_uint32), ("flags", c_uint32), ("code", c_uint64 * PY_MAX_FRAMES)]


class ProfKey(S):
    _fields_ = [
        ("tgid", c_uint32),
        ("tid", c_uint32),
        ("epoch", c_uint64),
        ("stack", c_uint64),
        ("ustack", c_int32),
        ("kstack", c_int32),
        ("kind", c_uint32),
        ("pad", c_uint32),
    ]


class ProfVal(S):
    _fields_ = [("count", c_uint64), ("ns", c_uint64)]


class GcKey(S):
    _fields_ = [("tgid", c_uint32), ("gen", c_int32), ("epoch", c_uint64)]


class PyOwedKey(S):
    _fields_ = [("tgid", c_uint32), ("call", c_uint32), ("epoch", c_uint64), ("stack", c_uint64)]


class GcVal(S):
    _fields_ = [("count", c_uint64), ("ns", c_uint64), ("max_ns", c_uint64), ("collected", c_int64)]


class RecPyMark(S):
    _fields_ = [
        ("h", RecHdr),
        ("stack", c_uint64),
        ("aux", c_uint64),
        ("weight", c_uint32),
        ("events", c_uint32),
    ]


class RecPySample(S):
    _fields_ = [("h", RecHdr), ("stack", c_uint64), ("ustack", c_int32), ("kstack", c_int32)]


class RecOffcpu(S):
    _fields_ = [
        ("h", RecHdr),
        ("start_ns", c_uint64),
        ("stack", c_uint64),
        ("ustack", c_int32),
        ("kstack", c_int32),
    ]


class RecPyCall(S):
    _fields_ = [("h", RecHdr), ("code", c_uint64), ("enter_ns", c_uint64)]


class RecCall(S):
    _fields_ = [("h", RecHdr), ("enter_ns", c_uint64), ("arg", c_uint64), ("stream", c_uint64)]


class RecGc(S):
    _fields_ = [
        ("h", RecHdr),
        ("start_ns", c_uint64),
        ("collected", c_int64),
        ("generation", c_int32),
        ("pad", c_uint32),
    ]


class RecStreamWait(S):
    _fields_ = [
        ("h", RecHdr),
        ("stream", c_uint64),
        ("event", c_uint64),
        ("pos", c_uint64),
        ("mark_stream", c_uint64),
        ("mark_pos", c_uint64),
        ("mark_ns", c_uint64),
    ]


class CollKey(S):
    _fields_ = [
        ("tgid", c_uint32),
        ("call", c_uint32),
        ("epoch", c_uint64),
        ("comm", c_uint64),
        ("dtype", c_uint32),
        ("pad", c_uint32),
    ]


class CollVal(S):
    _fields_ = [
        ("count", c_uint64),
        ("elems", c_uint64),
        ("host_ns", c_uint64),
        ("first_seq", c_uint64),
        ("first_enter", c_uint64),
        ("last_exit", c_uint64),
    ]


class SampleKey(S):
    _fields_ = [("tgid", c_uint32), ("pad", c_uint32), ("comm", c_uint64)]


class SampleVal(S):
    _fields_ = [
        ("stride", c_uint64),
        ("phase", c_uint64),
        ("skipped", c_uint64),
        ("last_seq", c_uint64),
        ("skip_pos", c_uint64),
    ]


class RecEventDone(S):
    _fields_ = [
        ("h", RecHdr),
        ("event", c_uint64),
        ("not_ready_ns", c_uint64),
        ("stream", c_uint64),
        ("pos", c_uint64),
        ("rec_ns", c_uint64),
        ("by_sync", c_uint32),
        ("pad", c_uint32),
    ]


class RecNetSend(S):
    _fields_ = [("h", RecHdr), ("prev_ns", c_uint64), ("pad", c_uint64)]


# C struct name -> mirror, for the layout test
MIRRORS: Dict[str, Type[S]] = {
    "target_cfg": TargetCfg,
    "rec_hdr": RecHdr,
    "rec_sync": RecSync,
    "rec_func_name": RecFuncName,
    "rec_event_record": RecEventRecord,
    "rec_elapsed": RecElapsed,
    "rec_nccl": RecNccl,
    "rec_comm_init": RecCommInit,
    "launch_key": LaunchKey,
    "hist_key": HistKey,
    "mem_key": MemKey,
    "mem_val": MemVal,
    "err_key": ErrKey,
    "call_key": CallKey,
    "coll_key": CollKey,
    "coll_val": CollVal,
    "sample_key": SampleKey,
    "sample_val": SampleVal,
    "inflight": Inflight,
    "usdt_arg": UsdtArg,
    "py_cfg": PyCfg,
    "py_stack": PyStack,
    "prof_key": ProfKey,
    "prof_val": ProfVal,
    "gc_key": GcKey,
    "py_owed_key": PyOwedKey,
    "gc_val": GcVal,
    "rec_py_mark": RecPyMark,
    "rec_py_sample": RecPySample,
    "rec_offcpu": RecOffcpu,
    "rec_py_call": RecPyCall,
    "rec_call": RecCall,
    "rec_gc": RecGc,
    "rec_stream_wait": RecStreamWait,
    "rec_event_done": RecEventDone,
    "rec_net_send": RecNetSend,
}

_BY_KIND: Dict[int, Type[S]] = {
    REC_SYNC: RecSync,
    REC_FUNC_NAME: RecFuncName,
    REC_EVENT_RECORD: RecEventRecord,
    REC_ELAPSED: RecElapsed,
    REC_NCCL: RecNccl,
    REC_COMM_INIT: RecCommInit,
    REC_PY_MARK: RecPyMark,
    REC_PY_SAMPLE: RecPySample,
    REC_OFFCPU: RecOffcpu,
    REC_PY_CALL: RecPyCall,
    REC_CALL: RecCall,
    REC_GC: RecGc,
    REC_STREAM_WAIT: RecStreamWait,
    REC_EVENT_DONE: RecEventDone,
    REC_NET_SEND: RecNetSend,
}
Record = Union[
    RecSync,
    RecFuncName,
    RecEventRecord,
    RecElapsed,
    RecNccl,
    RecCommInit,
    RecPyMark,
    RecPySample,
    RecOffcpu,
    RecPyCall,
    RecCall,
    RecGc,
    RecStreamWait,
    RecEventDone,
    RecNetSend,
]


class DecodeError(ValueError):
    pass


_HDR = ctypes.sizeof(RecHdr)
_SIZES = {k: ctypes.sizeof(c) for k, c in _BY_KIND.items()}


_KIND = struct.Struct("<I")


def decode_from(buf: Any, off: int, size: int) -> Record:
    """The record of `size` bytes at `off` of `buf` (bcc's ring callback memory, at an address)
    as its mirror struct, copied once."""
    if size < _HDR:
        raise DecodeError(f"short record ({size} bytes)")
    kind = _KIND.unpack_from(buf, off)[0]
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise DecodeError(f"unknown record kind {kind}")
    if size < _SIZES[kind]:
        raise DecodeError(f"record kind {kind} has {size} bytes, expected {_SIZES[kind]}")
    return cls.from_buffer_copy(buf, off)  # type: ignore[return-value]


def decode(data: bytes) -> Record:
    """A ring-buffer record as its mirror struct (a copy: the ring memory is reused)."""
    if len(data) < ctypes.sizeof(RecHdr):
        raise DecodeError(f"short record ({len(data)} bytes)")
    kind = int.from_bytes(data[:4], "little")
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise DecodeError(f"unknown record kind {kind}")
    if len(data) < ctypes.sizeof(cls):
        raise DecodeError(f"record kind {kind} has {len(data)} bytes, expected {ctypes.sizeof(cls)}")
    return cls.from_buffer_copy(data[: ctypes.sizeof(cls)])  # type: ignore[return-value]
