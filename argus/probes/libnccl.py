"""libnccl.so.2: what the NCCL channel probes, and what we know about communicator layouts.

pip wheels map NCCL from site-packages/nvidia/nccl/lib, so the library is found per process in
/proc/PID/maps. Source: argus/bpf/nccl.bpf.c.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

from argus.probes.base import (
    COLLECTIVE,
    COMM_INIT,
    GROUP,
    NET_SEND,
    P2P,
    Channel,
    LibraryProbes,
    MappedLibrary,
    UprobeSpec,
    find_library,
    register_channel,
)
from argus.probes.elf import Elf

S = UprobeSpec
SPECS = (
    S("ncclAllReduce", required=True, cls=COLLECTIVE),
    S("ncclBroadcast", cls=COLLECTIVE),
    S("ncclReduce", cls=COLLECTIVE),
    S("ncclAllGather", required=True, cls=COLLECTIVE),
    S("ncclReduceScatter", required=True, cls=COLLECTIVE),
    S("ncclSend", cls=P2P),
    S("ncclRecv", cls=P2P),
    S("ncclGroupStart", cls=GROUP),
    S("ncclGroupEnd", cls=GROUP),
    S("ncclCommInitRank", required=True, cls=COMM_INIT),
    S("ncclCommInitRankConfig", cls=COMM_INIT),
    S("ncclCommSplit", cls=COMM_INIT),
    S("ncclGetVersion", entry=False),
    S("ncclGetUniqueId", entry=False),
    S("ncclCommDestroy", entry=False),
    S("ncclCommAbort", entry=False),
    # the network transports' send, run by the proxy thread (local symbols of NVIDIA's builds)
    S("ncclNetSocketIsend", ret=False, report_missing=False, cls=NET_SEND),
    S("ncclIbIsend", ret=False, report_missing=False, cls=NET_SEND),
)
CHANNEL = Channel(
    name="nccl", library_re=r"libnccl\.so(\.\d+)*", source="nccl.bpf.c", specs=SPECS, macro="ARGUS_NCCL"
)
register_channel(CHANNEL)
# ncclGroupStart has no return program; keep the table honest
ENTRY_ONLY = frozenset({"ncclGroupStart", "ncclNetSocketIsend", "ncclIbIsend"})
NET_SENDS = frozenset(s.symbol for s in SPECS if s.cls == NET_SEND)

OPS = {
    "ncclAllReduce": "AllReduce",
    "ncclBroadcast": "Broadcast",
    "ncclReduce": "Reduce",
    "ncclAllGather": "AllGather",
    "ncclReduceScatter": "ReduceScatter",
    "ncclSend": "Send",
    "ncclRecv": "Recv",
}
DTYPE_NAMES = (
    "int8",
    "uint8",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "float8e4m3",
    "float8e5m2",
)
DTYPE_SIZES = (1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1)
REDOPS = ("sum", "prod", "max", "min", "avg")
OFF_UNKNOWN = 0xFFFFFFFF


@dataclass(frozen=True)
class CommLayout:
    """Where this build's struct ncclComm keeps what an observer needs (argus/probes/nccl_layout.py).

    `source`: "table" (a versioned table row validated against the accessors: commHash, rank and
    nRanks), "accessors" (rank and nRanks decoded from ncclCommUserRank/ncclCommCount; no commHash)
    or "none". Never a sequence counter: no NCCL field counts collectives one by one.
    """

    source: str
    comm_hash: int = OFF_UNKNOWN
    rank: int = OFF_UNKNOWN
    nranks: int = OFF_UNKNOWN
    note: str = ""

    @property
    def has_hash(self) -> bool:
        return self.comm_hash != OFF_UNKNOWN

    @property
    def has_ranks(self) -> bool:
        return self.rank != OFF_UNKNOWN and self.nranks != OFF_UNKNOWN


UNKNOWN_LAYOUT = CommLayout("none", note="no layout: communicators are identified by the aggregator")


def version_of(elf: Elf) -> Optional[int]:
    """NCCL_VERSION_CODE, read from ncclGetVersion's `movl $imm32,(%rdi)` (no process call needed)."""
    sym = elf.symbols.get("ncclGetVersion")
    if sym is None:
        return None
    code = elf.read(sym.offset, 64)
    i = code.find(b"\xc7\x07")
    if i < 0 or i + 6 > len(code):
        return None
    return struct.unpack_from("<i", code, i + 2)[0]


def layout_of(elf: Elf) -> CommLayout:
    """This build's communicator layout: a validated table row, else the decoded accessors, else none."""
    from argus.probes.nccl_layout import resolve_layout

    r = resolve_layout(elf, version_of(elf))

    def off(v: Optional[int]) -> int:
        return OFF_UNKNOWN if v is None else v

    if r.source == "table":
        return CommLayout("table", off(r.comm_hash), off(r.rank), off(r.nranks), r.note)
    if r.source == "accessors" and r.rank is not None and r.nranks is not None:
        return CommLayout("accessors", OFF_UNKNOWN, r.rank, r.nranks, r.note)
    return CommLayout("none", note=r.note or UNKNOWN_LAYOUT.note)


def detect(pid: int) -> Optional[MappedLibrary]:
    """libnccl.so.2 as mapped by `pid`, or None."""
    return find_library(pid, CHANNEL.library_re)


def version_text(v: Optional[int]) -> str:
    """22105 -> "2.21.5" (NCCL >= 2.9 codes); older codes (e.g. 2804) as 2.8.4."""
    if not v:
        return "unknown version"
    if v >= 10000:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def describe(lp: LibraryProbes) -> str:
    if lp.elf is None:
        return "unreadable"
    lay = layout_of(lp.elf)
    return f"NCCL {version_text(version_of(lp.elf))}, communicator layout from {lay.source}: {lay.note}"
