"""Choose where in a function's prologue to attach a uprobe.

A uprobe costs ~0.7 µs when the kernel can emulate the probed instruction (push, call, jmp) or
take its optimised path (5-byte nop), and ~13.6 µs when it must single-step it (FACTS.md). So:
attach past `endbr64`, and past a few instructions that touch neither the argument registers nor
the stack pointer, when that lands on an emulated instruction. Arguments (registers and stack
slots relative to rsp) and the return address read the same there as at the entry.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import List, Optional, Tuple

ENDBR64 = b"\xf3\x0f\x1e\xfa"
NOP5 = b"\x0f\x1f\x44\x00\x00"
MAX_SKIP_BYTES = 24
MAX_SKIP_INSNS = 4

_ARG_AND_STACK = {
    "rdi",
    "edi",
    "di",
    "dil",
    "rsi",
    "esi",
    "si",
    "sil",
    "rdx",
    "edx",
    "dx",
    "dl",
    "dh",
    "rcx",
    "ecx",
    "cx",
    "cl",
    "ch",
    "r8",
    "r8d",
    "r8w",
    "r8b",
    "r9",
    "r9d",
    "r9w",
    "r9b",
    "rsp",
    "esp",
    "sp",
    "spl",
    "rbp",
    "ebp",
    "bp",
    "bpl",
}
_NO_WRITE = {"test", "cmp", "nop", "nopw", "nopl", "endbr64", "xchg %ax,%ax"}
_WRITES_DEST = re.compile(r"^(mov[a-z]*|lea[a-z]?|xor[a-z]?|and[a-z]?|or[a-z]?|add[a-z]?|sub[a-z]?)$")


@dataclass(frozen=True)
class EntryPlan:
    offset: int  # bytes past the symbol to attach at
    fast: bool  # emulated or optimised: no single-step per hit
    insn: str  # the instruction probed
    note: str = ""


def fast_at(code: bytes) -> Optional[str]:
    """Name of the instruction at code[0] if the kernel emulates it, else None."""
    if not code:
        return None
    b = code[0]
    if 0x50 <= b <= 0x57:
        return "push"
    if b == 0x41 and len(code) > 1 and 0x50 <= code[1] <= 0x57:
        return "push"
    if code.startswith(NOP5):
        return "nop5"
    if b in (0xE8, 0xE9, 0xEB):
        return {0xE8: "call", 0xE9: "jmp", 0xEB: "jmp"}[b]
    return None


def _split_operands(ops: str) -> List[str]:
    out, depth, cur = [], 0, ""
    for ch in ops:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def skippable(mnemonic: str, operands: str) -> bool:
    """True when an instruction leaves argument registers, rsp/rbp and memory untouched."""
    if mnemonic in _NO_WRITE or mnemonic.startswith("nop"):
        return True
    if mnemonic.startswith(("test", "cmp")):
        return True
    if not _WRITES_DEST.match(mnemonic):
        return False
    ops = _split_operands(operands)
    if not ops:
        return False
    dest = ops[-1]
    if not dest.startswith("%"):
        return False  # a store: keep it conservative
    return dest[1:] not in _ARG_AND_STACK


def disassemble(path: str, vaddr: int, nbytes: int) -> List[Tuple[int, str, str]]:
    """(vaddr, mnemonic, operands) for instructions in [vaddr, vaddr+nbytes), via objdump."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return []
    res = subprocess.run(
        [
            objdump,
            "-d",
            "--no-show-raw-insn",
            f"--start-address={vaddr:#x}",
            f"--stop-address={vaddr + nbytes:#x}",
            path,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    out = []
    for line in res.stdout.splitlines():
        m = re.match(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*?)\s*(#.*)?$", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def plan_entry(code: bytes, path: str = "", vaddr: int = 0) -> EntryPlan:
    """Where to attach, given the first bytes of a function (and its file, for objdump)."""
    skip = 0
    if code.startswith(ENDBR64):
        skip = 4
    name = fast_at(code[skip:])
    if name:
        return EntryPlan(skip, True, name, "past endbr64" if skip else "")
    if path:
        insns = disassemble(path, vaddr + skip, MAX_SKIP_BYTES + 8)
        for i, (addr, mnem, ops) in enumerate(insns[: MAX_SKIP_INSNS + 1]):
            off = addr - vaddr
            if off > MAX_SKIP_BYTES:
                break
            name = fast_at(code[off:])
            if name and i > 0:
                return EntryPlan(off, True, name, f"past {i} harmless instruction(s)")
            if not skippable(mnem, ops):
                break
    first = insns_desc(code[skip:])
    return EntryPlan(skip, False, first, "single-stepped on every hit (~13 µs)")


def insns_desc(code: bytes) -> str:
    return " ".join(f"{b:02x}" for b in code[:6])
