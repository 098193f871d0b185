"""Decode NCCL's exported accessors (`ncclCommUserRank`, `ncclCommCount`, `ncclCommCuDevice`):
the offsets of `rank`, `nRanks` and `cudaDev` in this build's `struct ncclComm`.

Each accessor ends in `*out = comm->field`: a 32-bit load `mov D(%reg),%eXX` whose register is
stored through the output pointer. NVIDIA wraps the body in NVTX ranges and argument checks
(calls, branches), and the comm pointer may be copied to a callee-saved register or the stack
first, so this follows the comm and output pointers through the function's machine code by a
small dataflow over objdump's disassembly (register copies, stack spills, push/pop, calls that
clobber caller-saved registers — except what a called leaf function really changes) and returns
each D, or None with a note when the pattern is absent or ambiguous: never a guess. It reads only
the bytes of the three functions and of the leaf functions they call (objdump in binary mode):
~70 ms on NVIDIA's 344 MB 2.32.3 library. Used by argus/probes/nccl_layout.py.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from argus.probes.elf import Elf
from argus.probes.prologue import _split_operands


@dataclass(frozen=True)
class Accessors:
    """Offsets decoded from the exported accessors; None where not found (the notes say why)."""

    rank: Optional[int] = None
    nranks: Optional[int] = None
    cuda_dev: Optional[int] = None
    notes: Tuple[str, ...] = ()


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
