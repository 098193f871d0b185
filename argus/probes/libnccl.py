"""libnccl.so.2: what the NCCL channel probes, and what we know about communicator layouts.

pip wheels map NCCL from site-packages/nvidia/nccl/lib, so the library is found per process in
/proc/PID/maps. Source: bpf/nccl.bpf.c.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

from argus.probes.base import Channel, LibraryProbes, MappedLibrary, UprobeSpec, find_library, register_calls
from argus.probes.elf import Elf

S = UprobeSpec
SPECS = (
    S("ncclAllReduce", required=True),
    S("ncclBroadcast"),
    S("ncclReduce"),
    S("ncclAllGather", required=True),
    S("ncclReduceScatter", required=True),
    S("ncclSend"),
    S("ncclRecv"),
    S("ncclGroupStart"),
    S("ncclGroupEnd"),
    S("ncclCommInitRank", required=True),
    S("ncclCommInitRankConfig"),
    S("ncclCommSplit"),
    S("ncclGetVersion", entry=False),
    S("ncclGetUniqueId", entry=False),
    S("ncclCommDestroy", entry=False),
    S("ncclCommAbort", entry=False),
)
CHANNEL = Channel(
    name="nccl", library_re=r"libnccl\.so(\.\d+)*", source="nccl.bpf.c", specs=SPECS, macro="ARGUS_NCCL"
)
register_calls([s.symbol for s in SPECS])
# ncclGroupStart has no return program; keep the table honest
ENTRY_ONLY = frozenset({"ncclGroupStart"})

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
    """Offsets of fields in struct ncclComm that an observer needs, for one NCCL build."""

    name: str
    comm_hash: int = OFF_UNKNOWN
    rank: int = OFF_UNKNOWN
    nranks: int = OFF_UNKNOWN
    coll_opcount: int = OFF_UNKNOWN

    @property
    def known(self) -> bool:
        return self.coll_opcount != OFF_UNKNOWN


UNKNOWN_LAYOUT = CommLayout("unknown")


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
    """The communicator layout of this library. Known: the Argus simulator (marker symbol).

    NVIDIA builds are not in the table yet (their ncclComm offsets must be taken from each
    version's debug info on a GPU host); without it, sequence numbers are counted per process and
    communicators created before attach are identified by the aggregator from call signatures.
    """
    marker = elf.data_symbols.get("argusSimNcclMarker")
    if marker is not None and marker.size >= 20:
        version, h, rank, nranks, opcount = struct.unpack("<5I", elf.read(marker.offset, 20))
        if version == 1:
            return CommLayout("argus-sim v1", comm_hash=h, rank=rank, nranks=nranks, coll_opcount=opcount)
    return UNKNOWN_LAYOUT


def detect(pid: int) -> Optional[MappedLibrary]:
    """libnccl.so.2 as mapped by `pid`, or None."""
    return find_library(pid, CHANNEL.library_re)


def describe(lp: LibraryProbes) -> str:
    if lp.elf is None:
        return "unreadable"
    v = version_of(lp.elf)
    vs = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else "unknown version"
    return f"NCCL {vs}, layout {layout_of(lp.elf).name}"
