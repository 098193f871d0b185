"""Where `struct ncclComm` keeps `commHash`, `rank`, `nRanks` and `cudaDev`, for any libnccl.so.2.

Two sources, and the rule that combines them:

* the **accessors**: NCCL exports `ncclCommUserRank`, `ncclCommCount` and `ncclCommCuDevice`
  (in .dynsym even when stripped); each ends in `*out = comm->field`, a 32-bit load
  `mov D(%reg),%eXX` whose register is stored through the output pointer. `decode_accessors`
  follows the comm and output pointers through the function's machine code (register copies,
  stack spills, calls, branches) and returns each D, or None when the pattern is absent or
  ambiguous. It reads only the bytes of the three functions and of the leaf functions they call
  (objdump's binary mode decodes them): ~70 ms on NVIDIA's 344 MB 2.32.3 library.
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
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

from argus.probes.elf import Elf, ElfError
from argus.probes.prologue import _split_operands

# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class Accessors:
    """Offsets decoded from the exported accessors; None where not found (the notes say why)."""

    rank: Optional[int] = None
    nranks: Optional[int] = None
    cuda_dev: Optional[int] = None
    notes: Tuple[str, ...] = ()


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


# --------------------------------------------------------------------------- decoding the accessors

ACCESSORS = (("rank", "ncclCommUserRank"), ("nranks", "ncclCommCount"), ("cuda_dev", "ncclCommCuDevice"))
EM_X86_64 = 62
MAX_FUNC_BYTES = 1 << 16  # NVIDIA's accessors are ~0.7 KB; a bigger "accessor" is not one
NOSIZE_BYTES = 4096  # a symbol without a size: decode this much, only what is reachable counts

_GPR = (
    ("rax", "eax", "ax", "al", "ah"),
    ("rbx", "ebx", "bx", "bl", "bh"),
    ("rcx", "ecx", "cx", "cl", "ch"),
    ("rdx", "edx", "dx", "dl", "dh"),
    ("rsi", "esi", "si", "sil", ""),
    ("rdi", "edi", "di", "dil", ""),
    ("rbp", "ebp", "bp", "bpl", ""),
    ("rsp", "esp", "sp", "spl", ""),
)
# register name -> (64-bit name, width in bytes)
_REG: Dict[str, Tuple[str, int]] = {}
for _names in _GPR:
    for _n, _w in zip(_names, (8, 4, 2, 1, 1)):
        if _n:
            _REG[_n] = (_names[0], _w)
for _k in range(8, 16):
    for _suffix, _w in (("", 8), ("d", 4), ("w", 2), ("b", 1)):
        _REG[f"r{_k}{_suffix}"] = (f"r{_k}", _w)

_ALL64 = tuple(n[0] for n in _GPR) + tuple(f"r{k}" for k in range(8, 16))
CALLER_SAVED = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")
ARG_REGS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
_PREFIXES = frozenset(
    {"data16", "addr32", "rex", "rex.w", "rex.b", "rex.r", "rex.x", "cs", "ds", "es", "ss", "fs", "gs"}
    | {"notrack", "bnd", "lock", "rep", "repz", "repe", "repnz", "repne", "xacquire", "xrelease"}
)
_STRING_OPS = frozenset(
    f"{op}{s}"
    for op in ("stos", "movs", "lods", "scas", "cmps", "ins", "outs")
    for s in ("", "b", "w", "l", "q")
)
_IMPLICIT: Dict[str, Tuple[str, ...]] = {
    "cltq": ("rax",),
    "cwtl": ("rax",),
    "cbtw": ("rax",),
    "cqto": ("rdx",),
    "cltd": ("rdx",),
    "cwtd": ("rdx",),
    "mul": ("rax", "rdx"),
    "div": ("rax", "rdx"),
    "idiv": ("rax", "rdx"),
    "syscall": ("rax", "rcx", "r11"),
    "cpuid": ("rax", "rbx", "rcx", "rdx"),
    "rdtsc": ("rax", "rdx"),
    "rdtscp": ("rax", "rcx", "rdx"),
    "xgetbv": ("rax", "rdx"),
    "cmpxchg": ("rax",),
    "cmpxchg8b": ("rax", "rdx"),
    "cmpxchg16b": ("rax", "rdx"),
}
_READ_ONLY = re.compile(
    r"^(cmp[bwlq]?|test[bwlq]?|bt[wlq]?|v?u?comis[sd]|nop[wlq]?|endbr64|prefetch\w*|[lms]fence|pause)$"
)
# instructions that write their last operand and nothing else
_WRITES_LAST = re.compile(
    r"^(mov\w*|cmov\w+|set\w+|add[bwlq]?|sub[bwlq]?|and[bwlq]?|or[bwlq]?|xor[bwlq]?|adc[bwlq]?|sbb[bwlq]?|"
    r"inc[bwlq]?|dec[bwlq]?|neg[bwlq]?|not[bwlq]?|sh[lr][bwlq]?|sa[lr][bwlq]?|ro[lr][bwlq]?|rc[lr][bwlq]?|"
    r"sh[lr]d[wlq]?|lea[wlq]?|imul[wlq]?|bs[fr][wlq]?|lzcnt\w*|tzcnt\w*|popcnt\w*|bswap|bt[src][wlq]?|"
    r"cvt\w+|v?p\w+|v?\w+p[sd]|v?\w+s[sd]|v?mov\w+|kmov\w+)$"
)

# ("comm", off) | ("out", off) | ("sp", delta from entry rsp) | ("field", D) | ("reg", n): entry value
Val = Tuple[str, int]
SlotKey = Tuple[str, int, int]  # ("slot", delta, width)


@dataclass(frozen=True)
class _Insn:
    addr: int
    mnem: str
    ops: Tuple[str, ...]
    prefixes: FrozenSet[str]


@dataclass
class _Findings:
    fields: Set[int]
    unknown_stores: int = 0


_FLAGS = ("--no-show-raw-insn", "-w")


def _objdump(code: bytes, vaddr: int) -> Optional[List[_Insn]]:
    """Decode raw bytes with objdump's binary mode: no section or symbol tables are read."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    with tempfile.NamedTemporaryFile(prefix="argus-nccl-", suffix=".bin") as tmp:
        tmp.write(code)
        tmp.flush()
        res = subprocess.run(
            [
                objdump,
                "-D",
                "-b",
                "binary",
                "-m",
                "i386:x86-64",
                f"--adjust-vma={vaddr:#x}",
                *_FLAGS,
                tmp.name,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    out = []
    for line in res.stdout.splitlines():
        m = re.match(r"^\s*([0-9a-f]+):\s+(.*?)\s*(?:#.*)?$", line)
        if not m:
            continue
        words = m.group(2).split(None, 1)
        prefixes = set()
        # objdump prints prefixes as separate words ("data16 data16 rex.W call ...", "notrack jmp")
        while words and words[0].lower() in _PREFIXES and len(words) > 1:
            prefixes.add(words[0].lower())
            words = words[1].split(None, 1)
        if not words:
            continue
        ops = tuple(_split_operands(words[1])) if len(words) > 1 else ()
        out.append(_Insn(int(m.group(1), 16), words[0], ops, frozenset(prefixes)))
    return out


_MEM = re.compile(r"^(?:%[a-z]s:)?(-?0x[0-9a-f]+|-?\d+)?\((%\w+)?(?:,(%\w+)(?:,(\d))?)?\)$")


def _reg(op: str) -> Optional[Tuple[str, int]]:
    return _REG.get(op[1:]) if op.startswith("%") else None


def _is_mem(op: str) -> bool:
    return "(" in op or (not op.startswith(("%", "$", "*")) and bool(op))


class _State:
    """What is known at one instruction: registers and stack slots holding tracked values."""

    __slots__ = ("escape", "regs", "slots")

    def __init__(self) -> None:
        self.regs: Dict[str, Val] = {}
        self.slots: Dict[SlotKey, Val] = {}
        self.escape: Optional[int] = None  # lowest stack address handed out (callees may write above)

    def copy(self) -> _State:
        s = _State()
        s.regs = dict(self.regs)
        s.slots = dict(self.slots)
        s.escape = self.escape
        return s

    def meet(self, other: _State) -> bool:
        """Keep only facts true on both paths; True when something was dropped."""
        regs = {k: v for k, v in self.regs.items() if other.regs.get(k) == v}
        slots = {k: v for k, v in self.slots.items() if other.slots.get(k) == v}
        esc = self.escape
        if other.escape is not None:
            esc = other.escape if esc is None else min(esc, other.escape)
        changed = len(regs) != len(self.regs) or len(slots) != len(self.slots) or esc != self.escape
        self.regs, self.slots, self.escape = regs, slots, esc
        return changed

    def set_reg(self, name: str, width: int, val: Optional[Val]) -> None:
        full, _w = _REG[name]
        if val is None or width not in (4, 8):
            self.regs.pop(full, None)
        elif width == 4 and val[0] != "field":
            self.regs.pop(full, None)  # a 32-bit copy of a pointer is not the pointer
        else:
            self.regs[full] = val

    def get_reg(self, name: str, width: int) -> Optional[Val]:
        v = self.regs.get(_REG[name][0])
        if v is None:
            return None
        if v[0] == "field":
            return v if width == 4 else None
        return v if width == 8 else None

    def clobber_slots(self, lo: int, hi: int) -> None:
        for k in [k for k in self.slots if k[1] < hi and k[1] + k[2] > lo]:
            del self.slots[k]

    def store_slot(self, delta: int, width: int, val: Optional[Val]) -> None:
        self.clobber_slots(delta, delta + width)
        if val is not None and width in (4, 8) and (width == 4) == (val[0] == "field"):
            self.slots[("slot", delta, width)] = val
        if val is not None and val[0] == "sp":
            self._escaped(val[1])

    def _escaped(self, delta: int) -> None:
        self.escape = delta if self.escape is None else min(self.escape, delta)

    def address(self, op: str) -> Tuple[Optional[Val], bool]:
        """(tracked address of a memory operand or None, whether it may be on our stack)."""
        m = _MEM.match(op)
        if not m or op.startswith(("%fs:", "%gs:")):
            return None, False  # an absolute address, a global or thread-local storage
        disp = int(m.group(1), 0) if m.group(1) else 0
        base = m.group(2)
        if base is None or base == "%rip":
            return None, False
        b = self.regs.get(_REG[base[1:]][0]) if base[1:] in _REG else None
        if m.group(3):  # indexed: exact address unknown
            return None, bool(b and b[0] == "sp")
        if b is None or b[0] in ("field", "reg"):
            return None, False
        return (b[0], b[1] + disp), b[0] == "sp"


def _transfer(st: _State, ins: _Insn, found: _Findings, callees: Optional[_Callees]) -> None:
    """Apply one instruction to the state (in place), recording stores through the output pointer."""
    mn, ops = ins.mnem, ins.ops

    if mn in _STRING_OPS and (not ops or any(o.startswith(("%es:", "%ds:")) for o in ops)):
        for r in ("rax", "rcx", "rdi", "rsi"):
            st.regs.pop(r, None)
        st.slots.clear()  # rep stos/movs may fill our frame
        return
    if mn.startswith("call"):
        for r in ARG_REGS:
            v = st.regs.get(r)
            if v is not None and v[0] == "sp":
                st._escaped(v[1])  # a pointer into our frame handed to the callee
        clobbered: Tuple[str, ...] = CALLER_SAVED
        live = any(st.regs.get(r) is not None for r in CALLER_SAVED)
        if callees is not None and live and ins.ops and re.match(r"^0x[0-9a-f]+$", ins.ops[0]):
            clobbered = callees.clobbers(int(ins.ops[0], 16))
        for r in clobbered:
            st.regs.pop(r, None)
        if st.escape is not None:
            st.clobber_slots(st.escape, 1 << 40)
        return
    if mn.startswith(("j", "ret", "loop")) or mn in ("ud2", "hlt", "int3"):
        return
    if mn == "leave":  # rsp = rbp; pop rbp
        fp = st.regs.get("rbp")
        st.regs.pop("rsp", None)
        st.regs.pop("rbp", None)
        if fp is not None and fp[0] == "sp":
            st.regs["rsp"] = ("sp", fp[1] + 8)
            v = st.slots.get(("slot", fp[1], 8))
            if v is not None:
                st.regs["rbp"] = v
        return
    if mn in ("push", "pushq"):
        sp = st.regs.get("rsp")
        preg = _reg(ops[0]) if ops else None
        pushed = st.get_reg(ops[0][1:], preg[1]) if preg else None
        if sp is None or sp[0] != "sp":
            st.regs.pop("rsp", None)
            return
        st.regs["rsp"] = ("sp", sp[1] - 8)
        st.store_slot(sp[1] - 8, 8, pushed)
        return
    if mn in ("pop", "popq"):
        sp = st.regs.get("rsp")
        preg = _reg(ops[0]) if ops else None
        popped = st.slots.get(("slot", sp[1], 8)) if sp is not None and sp[0] == "sp" else None
        if sp is not None and sp[0] == "sp":
            st.regs["rsp"] = ("sp", sp[1] + 8)
        else:
            st.regs.pop("rsp", None)
        if preg:
            st.set_reg(ops[0][1:], 8, popped)
        return
    if _READ_ONLY.match(mn) or (mn == "xchg" and ops == ("%ax", "%ax")):
        return
    implicit = _IMPLICIT.get(mn)
    if implicit is None and mn[:-1] in ("mul", "div", "idiv"):  # mull, divq, ...
        implicit = _IMPLICIT[mn[:-1]]
    if mn.startswith("imul") and len(ops) == 1:
        implicit = ("rax", "rdx")
    if implicit:
        for r in implicit:
            st.regs.pop(r, None)
        if not mn.startswith("cmpxchg"):
            return  # their operand is a source
    if mn.startswith(("xchg", "xadd", "cmpxchg")) and ops:
        for op in ops:
            rr = _reg(op)
            if rr:
                st.regs.pop(rr[0], None)
            elif _is_mem(op):
                _mem_write(st, op, None, 64, found)
        return

    if mn in ("mov", "movl", "movq") and len(ops) == 2:
        src, dst = ops
        rs, rd = _reg(src), _reg(dst)
        if rs and rd:
            st.set_reg(dst[1:], rd[1], st.get_reg(src[1:], rs[1]) if rs[1] == rd[1] else None)
        elif rd and _is_mem(src):
            addr, _on_stack = st.address(src)
            val: Optional[Val] = None
            if addr is not None and addr[0] == "comm" and rd[1] == 4:
                val = ("field", addr[1])  # the 32-bit load the accessors end with
            elif addr is not None and addr[0] == "sp":
                val = st.slots.get(("slot", addr[1], rd[1]))
            st.set_reg(dst[1:], rd[1], val)
        elif rd:
            st.set_reg(dst[1:], rd[1], None)  # an immediate
        elif _is_mem(dst):
            if rs:
                _mem_write(st, dst, st.get_reg(src[1:], rs[1]), rs[1], found, from_reg=True)
            else:
                width = 8 if mn == "movq" else 4 if mn == "movl" else 8
                _mem_write(st, dst, None, width, found)
        return
    if mn.startswith("lea") and len(ops) == 2 and _reg(ops[1]):
        addr, _on_stack = st.address(ops[0])
        st.set_reg(ops[1][1:], _reg(ops[1])[1], addr)  # type: ignore[index]
        return
    if mn in ("add", "sub", "addq", "subq") and len(ops) == 2 and ops[0].startswith("$") and _reg(ops[1]):
        r, w = _reg(ops[1])  # type: ignore[misc]
        v = st.regs.get(r) if w == 8 else None
        if v is not None and v[0] not in ("field", "reg"):
            k = int(ops[0][1:], 0)
            st.regs[r] = (v[0], v[1] + (k if mn.startswith("add") else -k))
        else:
            st.regs.pop(r, None)
        return

    if _WRITES_LAST.match(mn) and ops:
        dst = ops[-1]
        rd = _reg(dst)
        if rd:
            st.regs.pop(rd[0], None)
        elif _is_mem(dst):
            _mem_write(st, dst, None, 64, found)
        return
    # anything else: assume it may have written any register
    st.regs.clear()


def _mem_write(
    st: _State, dst: str, val: Optional[Val], width: int, found: _Findings, from_reg: bool = False
) -> None:
    addr, on_stack = st.address(dst)
    if addr is not None and addr[0] == "sp":
        st.store_slot(addr[1], width, val)
        return
    if on_stack:  # an indexed store into our frame: nothing there is certain any more
        st.slots.clear()
    if addr is not None and addr[0] == "out" and addr[1] == 0 and from_reg:
        if val is not None and val[0] == "field" and width == 4:
            found.fields.add(val[1])
        else:
            found.unknown_stores += 1  # *out = something we cannot name: ambiguous
    if val is not None and val[0] == "sp":
        st._escaped(val[1])  # a frame address stored to memory may be written through later


def _successors(ins: _Insn, nxt: Optional[int], lo: int, hi: int) -> List[int]:
    mn = ins.mnem
    if mn.startswith("ret") or mn in ("ud2", "hlt", "(bad)", "int3"):
        return []
    if mn.startswith("j") or mn.startswith("loop"):
        tgt: List[int] = []
        if ins.ops and re.match(r"^0x[0-9a-f]+$", ins.ops[0]):
            t = int(ins.ops[0], 16)
            if lo <= t < hi:
                tgt.append(t)  # a jump out of the function is a tail call: nothing to follow
        if mn in ("jmp", "jmpq"):
            return tgt
        return tgt + ([nxt] if nxt is not None else [])
    return [nxt] if nxt is not None else []


def _dataflow(
    insns: List[_Insn], entry: _State, lo: int, hi: int, callees: Optional[_Callees]
) -> Tuple[List[Optional[_State]], bool]:
    """The state before each reachable instruction (None: unreachable), and whether some reachable
    path runs off the end of the decoded bytes."""
    index = {ins.addr: i for i, ins in enumerate(insns)}
    states: List[Optional[_State]] = [None] * len(insns)
    states[0] = entry
    work = [0]
    off_end = False
    steps = 0
    # forward data flow to a fixed point: the meet only drops facts, so this terminates
    while work:
        steps += 1
        if steps > 200000:
            raise _Unsettled()
        i = work.pop()
        st = states[i].copy()  # type: ignore[union-attr]
        _transfer(st, insns[i], _Findings(set()), callees)
        nxt = insns[i + 1].addr if i + 1 < len(insns) else None
        succ = _successors(insns[i], nxt, lo, hi)
        if nxt is None and _falls_through(insns[i]):
            off_end = True
        for t in succ:
            j = index.get(t)
            if j is None:
                continue  # a jump into the middle of an instruction: not followed
            if states[j] is None:
                states[j] = st.copy()
                work.append(j)
            elif states[j].meet(st):  # type: ignore[union-attr]
                work.append(j)
    return states, off_end


class _Unsettled(Exception):
    pass


def _falls_through(ins: _Insn) -> bool:
    mn = ins.mnem
    return not (mn.startswith("ret") or mn in ("jmp", "jmpq", "ud2", "hlt", "(bad)", "int3"))


class _Callees:
    """Which caller-saved registers a directly called function really writes.

    GCC's interprocedural register allocation (-fipa-ra, on at -O2 and -Os) keeps values in
    caller-saved registers across calls to functions it compiled in the same library when they
    leave those registers alone (e.g. `call valid` with the comm still in %rdi). So a direct call
    to a leaf function (no calls of its own, returns with %rsp balanced) clobbers only what its
    code writes; any other call clobbers every caller-saved register.
    """

    WINDOW = 1024  # a leaf check is a few dozen bytes; longer code is not summarised

    def __init__(self, read: Callable[[int, int], Optional[bytes]]) -> None:
        self.read = read
        self.cache: Dict[int, Tuple[str, ...]] = {}

    def clobbers(self, target: int) -> Tuple[str, ...]:
        if target not in self.cache:
            self.cache[target] = self._summarise(target)
        return self.cache[target]

    def _summarise(self, target: int) -> Tuple[str, ...]:
        code = self.read(target, self.WINDOW)
        if not code:
            return CALLER_SAVED
        insns = _objdump(code, target)
        if not insns or insns[0].addr != target:
            return CALLER_SAVED
        entry = _State()
        entry.regs = {r: ("reg", i) for i, r in enumerate(_ALL64)}
        entry.regs["rsp"] = ("sp", 0)
        try:
            states, off_end = _dataflow(insns, entry, target, target + len(code), None)
        except _Unsettled:
            return CALLER_SAVED
        if off_end:
            return CALLER_SAVED
        written: Set[str] = set()
        returns = 0
        for ins, st in zip(insns, states):
            if st is None:
                continue
            mn = ins.mnem
            if mn.startswith("call") or mn in _STRING_OPS:
                return CALLER_SAVED  # not a leaf
            if mn == "jmp" or mn == "jmpq":
                if not (ins.ops and re.match(r"^0x[0-9a-f]+$", ins.ops[0])):
                    return CALLER_SAVED  # an indirect jump: code we cannot see
                t = int(ins.ops[0], 16)
                if not target <= t < target + len(code):
                    return CALLER_SAVED  # a tail call
            if not mn.startswith("ret"):
                continue
            returns += 1
            if st.regs.get("rsp") != ("sp", 0):
                return CALLER_SAVED
            for i, r in enumerate(_ALL64):
                if r != "rsp" and st.regs.get(r) != ("reg", i):
                    written.add(r)
        if returns == 0:
            return CALLER_SAVED
        return tuple(r for r in CALLER_SAVED if r in written)


def decode_function(
    code: bytes, vaddr: int, read: Optional[Callable[[int, int], Optional[bytes]]] = None
) -> Tuple[Optional[int], str]:
    """(D, "") when every `*out = ...` store is `*out = *(int*)(comm + D)`; else (None, why).

    `read(vaddr, n)` gives the bytes of called functions, to see which registers they keep.
    """
    return _decode(code, vaddr, _Callees(read) if read else None)


def _decode(code: bytes, vaddr: int, callees: Optional[_Callees]) -> Tuple[Optional[int], str]:
    insns = _objdump(code, vaddr)
    if insns is None:
        return None, "objdump not found (install binutils)"
    if not insns:
        return None, "objdump decoded nothing"
    entry = _State()
    entry.regs = {"rdi": ("comm", 0), "rsi": ("out", 0), "rsp": ("sp", 0)}
    try:
        states, _off_end = _dataflow(insns, entry, vaddr, vaddr + len(code), callees)
    except _Unsettled:
        return None, "data flow did not settle"
    # with the states settled, collect the stores through the output pointer
    found = _Findings(set())
    for ins, st in zip(insns, states):
        if st is not None:
            _transfer(st.copy(), ins, found, callees)
    if found.unknown_stores:
        return None, f"{found.unknown_stores} store(s) through the output pointer of an untracked value"
    if not found.fields:
        return None, "no `*out = comm->field` store found"
    if len(found.fields) > 1:
        return None, "ambiguous: stores of " + ", ".join(str(d) for d in sorted(found.fields))
    return next(iter(found.fields)), ""


PF_X = 1


def _code_reader(path: str) -> Callable[[int, int], Optional[bytes]]:
    """read(vaddr, n): up to n bytes of the executable segment holding vaddr, or None."""
    spans: List[Tuple[int, int, int]] = []
    try:
        with open(path, "rb") as f:
            hdr = f.read(64)
            phoff = struct.unpack_from("<Q", hdr, 32)[0]
            phentsize, phnum = struct.unpack_from("<HH", hdr, 54)
            f.seek(phoff)
            raw = f.read(phentsize * phnum)
        for k in range(phnum):
            p_type, p_flags, p_offset, p_vaddr, _pa, p_filesz, _mem, _al = struct.unpack_from(
                "<IIQQQQQQ", raw, k * phentsize
            )
            if p_type == 1 and p_flags & PF_X:
                spans.append((p_vaddr, p_offset, p_filesz))
    except (OSError, struct.error):
        pass

    def read(vaddr: int, n: int) -> Optional[bytes]:
        for va, off, size in spans:
            if va <= vaddr < va + size:
                with open(path, "rb") as f:
                    f.seek(off + vaddr - va)
                    return f.read(min(n, va + size - vaddr))
        return None

    return read


def _machine(elf: Elf) -> int:
    return struct.unpack("<H", elf.read(18, 2))[0]


def decode_accessors(elf: Elf) -> Accessors:
    """The offsets `ncclCommUserRank`, `ncclCommCount`, `ncclCommCuDevice` read from the comm."""
    if _machine(elf) != EM_X86_64:
        return Accessors(notes=("not an x86-64 library: accessors not decoded",))
    got: Dict[str, Optional[int]] = {}
    notes: List[str] = []
    callees = _Callees(_code_reader(elf.path))  # shared: the accessors call the same checks
    for field, name in ACCESSORS:
        sym = elf.symbols.get(name) or elf.symbols.get("p" + name)
        if sym is None:
            got[field] = None
            notes.append(f"{name}: not exported")
            continue
        size = sym.size or NOSIZE_BYTES
        if size > MAX_FUNC_BYTES:
            got[field] = None
            notes.append(f"{name}: {size} bytes, too big for an accessor")
            continue
        off, why = _decode(elf.read(sym.offset, size), sym.vaddr, callees)
        got[field] = off
        if off is None:
            notes.append(f"{name}: {why}")
    return Accessors(got["rank"], got["nranks"], got["cuda_dev"], tuple(notes))


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
