"""See through dispatch stubs: probe the function a library's exported symbol jumps to.

NVIDIA's libcuda.so.1 exports each `cu*` function as a 32-byte stub, `cmpl $magic, state(%rip);
je <deinit>; jmp *slot(%rip)`, whose slot the dynamic loader fills with the real implementation (an
`R_X86_64_RELATIVE` relocation). A uprobe on the stub's RIP-relative `cmpl` is single-stepped on
every hit (~13 µs, FACTS.md); the implementation starts with an ordinary `push` (~1 µs). The stub
only reads memory and branches before its jump, so the implementation sees the caller's argument
registers, stack and return address: entry and return probes there read what they would at the
symbol. Code that took the stub's address (`cuGetProcAddress` hands those out) runs through the
same slot, so one probe at the implementation counts both ways in once.

The slot's value in the target's memory is checked at attach: a tool that replaced it (an
interposer, a profiler's dispatch table) is what the process really calls, so it is probed instead.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable, List, Optional

from argus.probes.elf import Elf, ElfError

MAX_STUB_BYTES = 48  # NVIDIA's stubs are 32 bytes; a guard or two more is still a stub
MAX_STUB_INSNS = 8


@dataclass(frozen=True)
class Stub:
    slot: int  # vaddr of the pointer the stub jumps through
    target: Optional[int]  # vaddr its relocation stores there (None: known only at run time)


def _rip_modrm(code: bytes, i: int) -> bool:
    """ModRM at code[i] addresses memory as disp32(%rip) (mod 00, r/m 101)."""
    return i < len(code) and code[i] & 0xC7 == 0x05


def _reads_only(op: int, modrm: int) -> bool:
    """The group-1 (80/81/83) /7 is cmp, the group-3 (F6/F7) /0 is test: both only set flags."""
    return (modrm >> 3) & 7 == (0 if op in (0xF6, 0xF7) else 7)


def _self_zero_extend(code: bytes, i: int) -> bool:
    """movzb/movzw of a register into itself (`40 0f b6 f6` = movzbl %sil,%esi). The ABI leaves a
    narrow argument's upper bits undefined, so the callee reads the same value afterwards."""
    rex = 0
    if i < len(code) and 0x40 <= code[i] <= 0x4F:
        rex, i = code[i], i + 1
    if i + 2 >= len(code) or code[i] != 0x0F or code[i + 1] not in (0xB6, 0xB7):
        return False
    modrm = code[i + 2]
    reg = ((modrm >> 3) & 7) | ((rex & 4) << 1)
    rm = (modrm & 7) | ((rex & 1) << 3)
    return modrm >> 6 == 3 and reg == rm


def stub_slot(code: bytes, vaddr: int) -> Optional[int]:
    """If `code` (a function's first bytes, at `vaddr`) is a dispatch stub — instructions that only
    compare, test and branch, then `jmp *disp32(%rip)` — the vaddr of the slot it jumps through."""
    i = 0
    for _ in range(MAX_STUB_INSNS):
        if i >= min(len(code), MAX_STUB_BYTES):
            return None
        rex_w = code[i] == 0x48
        j = i + 1 if rex_w else i
        op = code[j] if j < len(code) else -1
        if code.startswith(b"\xf3\x0f\x1e\xfa", i):  # endbr64
            i += 4
        elif op in (0x3E, 0xF2) and code.startswith(b"\xff\x25", j + 1):  # notrack/bnd jmp
            i = j + 1
        elif op == 0xFF and j + 1 < len(code) and code[j + 1] == 0x25:  # jmp *disp32(%rip)
            if j + 6 > len(code):
                return None
            (disp,) = struct.unpack_from("<i", code, j + 2)
            return vaddr + j + 6 + disp
        elif (
            op in (0x80, 0x81, 0x83, 0xF6, 0xF7) and _rip_modrm(code, j + 1) and _reads_only(op, code[j + 1])
        ):
            i = j + (10 if op in (0x81, 0xF7) else 7)  # cmp/test $imm, disp32(%rip)
        elif op in (0x39, 0x3B, 0x85) and _rip_modrm(code, j + 1):
            i = j + 6  # cmp/test %reg, disp32(%rip): reads only
        elif 0x70 <= op <= 0x7F and not rex_w:  # jcc rel8: a guard's side path (e.g. deinitialised)
            i += 2
        elif op == 0x0F and j + 1 < len(code) and 0x80 <= code[j + 1] <= 0x8F and not rex_w:  # jcc rel32
            i += 6
        elif op == 0x90 and not rex_w:
            i += 1
        elif _self_zero_extend(code, i):  # movzbl %sil,%esi: a narrow argument, its value kept
            i += 4 if 0x40 <= code[i] <= 0x4F else 3
        else:
            return None
    return None


def find_stub(elf: Elf, vaddr: int, code: bytes) -> Optional[Stub]:
    slot = stub_slot(code, vaddr)
    if slot is None:
        return None
    return Stub(slot, elf.pointer_at(slot))


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    pgoff: int
    path: str  # "" for anonymous memory


def mappings(pid: int) -> List[Mapping]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5:
                continue
            lo, hi = parts[0].split("-")
            path = parts[5].strip() if len(parts) == 6 else ""
            out.append(
                Mapping(int(lo, 16), int(hi, 16), int(parts[2], 16), path if path.startswith("/") else "")
            )
    return out


def load_bias(maps: List[Mapping], elf: Elf, inode_path: str) -> Optional[int]:
    """Process address minus ELF vaddr for the library whose file is `inode_path` (a realpath)."""
    for m in maps:
        if not m.path:
            continue
        if (
            os.path.basename(m.path) != os.path.basename(inode_path)
            and os.path.realpath(m.path) != inode_path
        ):
            continue
        v = elf.offset_to_vaddr(m.pgoff)
        if v is not None:
            return m.start - (v - v % 4096)
    return None


@dataclass(frozen=True)
class LiveTarget:
    """Where a slot points in one process: a file and its vaddr, or anonymous memory."""

    address: int
    path: str = ""  # as the process maps it; "" when not file-backed
    vaddr: int = 0  # in that file


def read_slot(pid: int, address: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.seek(address)
            raw = f.read(8)
    except (OSError, ValueError, OverflowError):
        return None
    return struct.unpack("<Q", raw)[0] if len(raw) == 8 else None


def locate(maps: List[Mapping], address: int, open_elf: Callable[[str], Elf]) -> LiveTarget:
    for m in maps:
        if m.start <= address < m.end:
            if not m.path:
                return LiveTarget(address)
            try:
                elf = open_elf(m.path)
            except (OSError, ElfError):
                return LiveTarget(address)
            v = elf.offset_to_vaddr(address - m.start + m.pgoff)
            return LiveTarget(address, m.path, v) if v is not None else LiveTarget(address)
    return LiveTarget(address)
