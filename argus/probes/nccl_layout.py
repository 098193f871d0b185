"""Where `struct ncclComm` keeps `commHash`, `rank`, `nRanks` and `cudaDev`, for any libnccl.so.2.

Two sources, and the rule that combines them:

* the **accessors**: NCCL exports `ncclCommUserRank`, `ncclCommCount` and `ncclCommCuDevice`
  (in .dynsym even when stripped); each ends in `*out = comm->field`. `decode_accessors`
  (argus/probes/nccl_accessors.py) follows the comm and output pointers through their machine
  code and returns each field's offset, or None when the pattern is absent or ambiguous:
  ~70 ms on NVIDIA's 344 MB 2.32.3 library.
* the **table** (`TABLE`): rows derived from each NVIDIA wheel's own DWARF (`derive`; each row
  also agrees with the wheel's accessors and with /work/shared/reference/nvidia-libraries.md), keyed
  by the library's GNU build id, and rows keyed by *accessor fingerprint* (`build_id=None`: any build
  of that version whose accessors decode to exactly the row's rank/nRanks offsets) for builds
  whose id changes with every compile (the Argus simulator, vendor forks). Only the table knows
  `commHash` (no exported function reads it).
* `resolve_layout` combines them: a table row is used only when the accessors confirm its
  rank/nRanks offsets (or, when they cannot be decoded, when the build id matches exactly); else
  the accessors' own offsets, without commHash; else nothing. No unvalidated offset is returned.

`op_count` / `coll_op_count` are recorded for information only: no NCCL field is a per-collective
sequence number (`opCount` advances once per kernel plan, and only with proxy work in 2.27;
`collOpCount` only in `uploadProxyOps`), so the agent does not read them; sequence numbers are
counted per process from attach (see /work/shared/reference/nvidia-libraries.md).

    python -m argus.probes.nccl_layout show LIB...      # version, build id, accessors, resolved layout
    python -m argus.probes.nccl_layout derive LIB...    # table rows from the library's DWARF
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from argus.probes.elf import Elf, ElfError
from argus.probes.nccl_accessors import Accessors, decode_accessors, decode_function

__all__ = ["TABLE", "Accessors", "LayoutRow", "Resolved", "build_id", "decode_accessors", "decode_function"]

# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class LayoutRow:
    version: int  # NCCL_VERSION_CODE
    build_id: Optional[str]  # full hex; None: keyed by accessor fingerprint (see module doc)
    comm_hash: int
    rank: int
    nranks: int
    cuda_dev: Optional[int]
    op_count: Optional[int]  # information only: not a per-collective sequence number
    coll_op_count: Optional[int]  # information only (2.24+)
    label: str
    derived: str  # the exact command that produced the row


@dataclass(frozen=True)
class Resolved:
    source: str  # "table" | "accessors" | "none"
    comm_hash: Optional[int]
    rank: Optional[int]
    nranks: Optional[int]
    cuda_dev: Optional[int]
    row: Optional[LayoutRow]
    note: str


# --------------------------------------------------------------------------- the table

_WHEEL = (
    "pip download --no-deps --only-binary=:all: {pkg} && unzip -o {whl} nvidia/nccl/lib/libnccl.so.2 && "
    "python -m argus.probes.nccl_layout derive nvidia/nccl/lib/libnccl.so.2"
)


# The simulator (argus/sim/csrc/nccl.c) is built with -g, so `derive` reads its DWARF directly.
_SIM_DERIVED = (
    "python -m argus.probes.nccl_layout derive --any-build "
    "--label 'argus simulator (any build)' \"$(argus sim build | awk '/libnccl/ {print $2}')\""
)

TABLE: Tuple[LayoutRow, ...] = (
    LayoutRow(
        version=21801,
        build_id="1dad5f311750cd2062c4f0915aec7610635e0a7d",
        comm_hash=9168,
        rank=9176,
        nranks=9180,
        cuda_dev=9184,
        op_count=9400,
        coll_op_count=None,
        label="NVIDIA 2.18.1 (nvidia-nccl-cu12 wheel)",
        derived=_WHEEL.format(
            pkg="nvidia-nccl-cu12==2.18.1", whl="nvidia_nccl_cu12-2.18.1-py3-none-manylinux1_x86_64.whl"
        ),
    ),
    LayoutRow(
        version=22105,
        build_id="2e87d0e7f2a98a3fc40945c13c095f8b7e5ef72b",
        comm_hash=13528,
        rank=13536,
        nranks=13540,
        cuda_dev=13544,
        op_count=13792,
        coll_op_count=None,
        label="NVIDIA 2.21.5 (nvidia-nccl-cu12 wheel)",
        derived=_WHEEL.format(
            pkg="nvidia-nccl-cu12==2.21.5", whl="nvidia_nccl_cu12-2.21.5-py3-none-manylinux2014_x86_64.whl"
        ),
    ),
    LayoutRow(
        version=22705,
        build_id="3c098e0640c8b4936323d594852079dac2cde793",
        comm_hash=1066160,
        rank=1066168,
        nranks=1066172,
        cuda_dev=1066176,
        op_count=1066432,
        coll_op_count=1066440,
        label="NVIDIA 2.27.5 (nvidia-nccl-cu12 wheel)",
        derived=_WHEEL.format(
            pkg="nvidia-nccl-cu12==2.27.5",
            whl="nvidia_nccl_cu12-2.27.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        ),
    ),
    LayoutRow(
        version=22803,
        build_id="ca97fb541b4a564925a043151ac6beb3b0e756ea",
        comm_hash=1066176,
        rank=1066184,
        nranks=1066188,
        cuda_dev=1066192,
        op_count=1066472,
        coll_op_count=1066480,
        label="NVIDIA 2.28.3 (nvidia-nccl-cu13 wheel)",
        derived=_WHEEL.format(
            pkg="nvidia-nccl-cu13==2.28.3", whl="nvidia_nccl_cu13-2.28.3-py3-none-manylinux_2_18_x86_64.whl"
        ),
    ),
    LayoutRow(
        version=23203,
        build_id="ef499dcea939dc594e1f28f9a53cc46da3e41399",
        comm_hash=1181408,
        rank=1181416,
        nranks=1181420,
        cuda_dev=1181424,
        op_count=1181720,
        coll_op_count=1181728,
        label="NVIDIA 2.32.3 (nvidia-nccl-cu13 wheel)",
        derived=_WHEEL.format(
            pkg="nvidia-nccl-cu13==2.32.3", whl="nvidia_nccl_cu13-2.32.3-py3-none-manylinux_2_27_x86_64.whl"
        ),
    ),
    LayoutRow(
        version=22105,
        build_id=None,  # its build id changes with every edit of nccl.c: keyed by accessor fingerprint
        comm_hash=8,
        rank=16,
        nranks=20,
        cuda_dev=24,
        op_count=40,
        coll_op_count=32,
        label="argus simulator (any build)",
        derived=_SIM_DERIVED,
    ),
)


# --------------------------------------------------------------------------- build id

PT_NOTE = 4
SHT_NOTE = 7
NT_GNU_BUILD_ID = 3


def _notes(data: bytes, align: int) -> Iterable[Tuple[bytes, int, bytes]]:
    """(name, type, desc) of each ELF note in `data`."""
    i = 0
    align = 8 if align == 8 else 4
    while i + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, i)
        i += 12
        name = data[i : i + namesz].rstrip(b"\0")
        i += (namesz + align - 1) // align * align
        desc = data[i : i + descsz]
        i += (descsz + align - 1) // align * align
        yield name, ntype, desc


def build_id(path: str) -> Optional[str]:
    """The GNU build id (lowercase hex) from the ELF's PT_NOTE segments (or SHT_NOTE sections)."""
    try:
        with open(path, "rb") as f:
            hdr = f.read(64)
            if len(hdr) < 64 or hdr[:4] != b"\x7fELF" or hdr[4] != 2 or hdr[5] != 1:
                return None
            phoff, shoff = struct.unpack_from("<QQ", hdr, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", hdr, 54)
            spans: List[Tuple[int, int, int]] = []  # (offset, size, align)
            f.seek(phoff)
            raw = f.read(phentsize * phnum)
            for k in range(phnum):
                p_type, _fl, p_offset, _va, _pa, p_filesz, _mem, p_align = struct.unpack_from(
                    "<IIQQQQQQ", raw, k * phentsize
                )
                if p_type == PT_NOTE:
                    spans.append((p_offset, p_filesz, p_align))
            if not spans and shoff:  # no program headers (an object file): the sections
                f.seek(shoff)
                raw = f.read(shentsize * shnum)
                for k in range(shnum):
                    _n, sh_type, _fl, _a, sh_offset, sh_size, _l, _i, sh_align, _e = struct.unpack_from(
                        "<IIQQQQIIQQ", raw, k * shentsize
                    )
                    if sh_type == SHT_NOTE:
                        spans.append((sh_offset, sh_size, sh_align))
            for off, size, align in spans:
                f.seek(off)
                for name, ntype, desc in _notes(f.read(min(size, 1 << 16)), align):
                    if name == b"GNU" and ntype == NT_GNU_BUILD_ID and desc:
                        return desc.hex()
    except (OSError, struct.error):
        return None
    return None


# --------------------------------------------------------------------------- resolving


def version_str(code: Optional[int]) -> str:
    if code is None:
        return "unknown version"
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"  # NCCL < 2.9 used major*1000


def _row_fits(row: LayoutRow, acc: Accessors) -> Optional[str]:
    """None when every decoded offset equals the row's; else what disagrees."""
    diffs = []
    for name, decoded, claimed in (
        ("rank", acc.rank, row.rank),
        ("nRanks", acc.nranks, row.nranks),
        ("cudaDev", acc.cuda_dev, row.cuda_dev),
    ):
        if decoded is not None and claimed is not None and decoded != claimed:
            diffs.append((name, decoded, claimed))
    if not diffs:
        return None
    got = ", ".join(f"{n}@{d}" for n, d, _c in diffs)
    said = "/".join(str(c) for _n, _d, c in diffs)
    return f"accessors decode {got}, the row says {said}"


def resolve_layout(elf: Elf, version: Optional[int], accessors: Optional[Accessors] = None) -> Resolved:
    """The ncclComm offsets to use for this library, each validated (see the module doc)."""
    acc = accessors if accessors is not None else decode_accessors(elf)
    bid = build_id(elf.path)
    who = f"NCCL {version_str(version)} build {bid[:8] + '…' if bid else '(no build id)'}"
    decoded = acc.rank is not None and acc.nranks is not None
    exact = [r for r in TABLE if bid is not None and r.build_id == bid]
    fingerprint = [r for r in TABLE if r.build_id is None and version is not None and r.version == version]
    rejected: List[str] = []
    for row in exact:
        if version is not None and row.version != version:
            rejected.append(f"row {row.label}: build id matches but the library says {version_str(version)}")
            continue
        why = _row_fits(row, acc)
        if why is None:
            how = "validated by the accessors" if decoded else "exact build id (accessors not decoded)"
            return _from_row(row, f"{who}: table row {row.label} {how}")
        rejected.append(f"table row for {version_str(row.version)} rejected: {why}")
    if not exact:
        for row in fingerprint:
            if not decoded:
                rejected.append(f"row {row.label} needs the accessors, which did not decode")
                continue
            why = _row_fits(row, acc)
            if why is None and row.rank == acc.rank and row.nranks == acc.nranks:
                return _from_row(row, f"{who}: table row {row.label} matches the accessor fingerprint")
            rejected.append(f"table row {row.label} rejected: {why}")
    tail = ("; " + "; ".join(rejected)) if rejected else ("; no table row" if not exact else "")
    if acc.rank is not None or acc.nranks is not None or acc.cuda_dev is not None:
        found = ", ".join(
            f"{n}@{v}"
            for n, v in (("rank", acc.rank), ("nRanks", acc.nranks), ("cudaDev", acc.cuda_dev))
            if v is not None
        )
        note = f"{who}: offsets from the accessors ({found}), commHash unknown{tail}"
        return Resolved("accessors", None, acc.rank, acc.nranks, acc.cuda_dev, None, note)
    why = "; ".join(acc.notes) or "accessors not decoded"
    return Resolved("none", None, None, None, None, None, f"{who}: no layout ({why}){tail}")


def _from_row(row: LayoutRow, note: str) -> Resolved:
    return Resolved("table", row.comm_hash, row.rank, row.nranks, row.cuda_dev, row, note)


# --------------------------------------------------------------------------- DWARF


class DeriveError(RuntimeError):
    pass


MEMBERS = {
    b"commHash": "comm_hash",
    b"rank": "rank",
    b"nRanks": "nranks",
    b"cudaDev": "cuda_dev",
    b"opCount": "op_count",
    b"collOpCount": "coll_op_count",
}


def _member_offset(die) -> Optional[int]:  # type: ignore[no-untyped-def]
    attr = die.attributes.get("DW_AT_data_member_location")
    if attr is None:
        return None
    if isinstance(attr.value, int):
        return attr.value
    # DWARF 2 style: an expression, DW_OP_plus_uconst ULEB128
    raw = bytes(attr.value)
    if raw and raw[0] == 0x23:
        val, shift = 0, 0
        for b in raw[1:]:
            val |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return val
    return None


def dwarf_ncclcomm(path: str) -> Tuple[int, Dict[str, Optional[int]]]:
    """(sizeof, {field: offset}) of struct ncclComm from the library's DWARF, or DeriveError."""
    try:
        from elftools.elf.elffile import ELFFile
    except ImportError as e:
        raise DeriveError("pyelftools is not installed (pip install 'pyelftools>=0.29')") from e
    with open(path, "rb") as f:
        ef = ELFFile(f)
        if not ef.has_dwarf_info() or ef.get_section_by_name(".debug_info") is None:
            raise DeriveError(f"{path}: no DWARF (.debug_info)")
        dw = ef.get_dwarf_info()
        for cu in dw.iter_CUs():
            todo = list(cu.get_top_DIE().iter_children())
            while todo:  # the struct is at file scope, or inside a namespace
                die = todo.pop(0)
                if die.tag == "DW_TAG_namespace":
                    todo.extend(die.iter_children())
                    continue
                if die.tag not in ("DW_TAG_structure_type", "DW_TAG_class_type"):
                    continue
                name = die.attributes.get("DW_AT_name")
                if name is None or name.value != b"ncclComm" or "DW_AT_declaration" in die.attributes:
                    continue
                out: Dict[str, Optional[int]] = dict.fromkeys(MEMBERS.values())
                for m in die.iter_children():
                    mn = m.attributes.get("DW_AT_name")
                    if m.tag == "DW_TAG_member" and mn is not None and mn.value in MEMBERS:
                        out[MEMBERS[mn.value]] = _member_offset(m)
                size = die.attributes.get("DW_AT_byte_size")
                return (size.value if size is not None else -1), out
    raise DeriveError(f"{path}: DWARF has no definition of struct ncclComm")


def derive(path: str, label: Optional[str] = None, any_build: bool = False) -> Tuple[LayoutRow, int]:
    """A table row (and sizeof(struct ncclComm)) from the library's own DWARF."""
    from argus.probes.libnccl import version_of

    size, f = dwarf_ncclcomm(path)
    missing = [k for k in ("comm_hash", "rank", "nranks") if f[k] is None]
    if missing:
        raise DeriveError(f"{path}: struct ncclComm lacks {', '.join(missing)}")
    version = version_of(Elf(path))
    if version is None:
        raise DeriveError(f"{path}: no ncclGetVersion to read the version from")
    row = LayoutRow(
        version=version,
        build_id=None if any_build else build_id(path),
        comm_hash=f["comm_hash"],  # type: ignore[arg-type]
        rank=f["rank"],  # type: ignore[arg-type]
        nranks=f["nranks"],  # type: ignore[arg-type]
        cuda_dev=f["cuda_dev"],
        op_count=f["op_count"],
        coll_op_count=f["coll_op_count"],
        label=label or f"NCCL {version_str(version)}",
        derived=f"python -m argus.probes.nccl_layout derive {path}",
    )
    return row, size


# --------------------------------------------------------------------------- CLI


def _fmt(v: Optional[int]) -> str:
    return "-" if v is None else str(v)


def show(paths: Sequence[str]) -> int:
    from argus.probes.libnccl import version_of

    rc = 0
    for path in paths:
        try:
            elf = Elf(path)
        except (OSError, ElfError) as e:
            print(f"{path}: {e}")
            rc = 1
            continue
        version = version_of(elf)
        t0 = time.perf_counter()
        acc = decode_accessors(elf)
        dt = time.perf_counter() - t0
        res = resolve_layout(elf, version, acc)
        print(path)
        print(f"  version    {version_str(version)} ({_fmt(version)})")
        print(f"  build id   {build_id(path) or '-'}")
        print(
            f"  accessors  rank@{_fmt(acc.rank)} nRanks@{_fmt(acc.nranks)} cudaDev@{_fmt(acc.cuda_dev)}"
            f" ({dt * 1000:.1f} ms)"
        )
        for n in acc.notes:
            print(f"             {n}")
        print(
            f"  layout     {res.source}: commHash@{_fmt(res.comm_hash)} rank@{_fmt(res.rank)}"
            f" nRanks@{_fmt(res.nranks)} cudaDev@{_fmt(res.cuda_dev)}"
        )
        print(f"             {res.note}")
    return rc


def derive_cmd(paths: Sequence[str], label: Optional[str], any_build: bool) -> int:
    rc = 0
    for path in paths:
        try:
            row, size = derive(path, label, any_build)
        except (DeriveError, OSError, ElfError) as e:
            print(f"error: {e}")
            rc = 1
            continue
        print(f"# {path}: sizeof(struct ncclComm) = {size}")
        print(f"{row!r},")
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m argus.probes.nccl_layout", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show", help="version, build id, decoded accessors and the resolved layout")
    s.add_argument("libs", nargs="+")
    d = sub.add_parser("derive", help="table rows from the libraries' DWARF")
    d.add_argument("libs", nargs="+")
    d.add_argument("--label", help="the row's label")
    d.add_argument("--any-build", action="store_true", help="key the row by accessor fingerprint")
    a = p.parse_args(argv)
    if a.cmd == "show":
        return show(a.libs)
    return derive_cmd(a.libs, a.label, a.any_build)


if __name__ == "__main__":
    sys.exit(main())
