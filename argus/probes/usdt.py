"""USDT (SystemTap SDT) probes of an ELF file: locations, semaphores and argument locations.

bcc wants USDT contexts at compile time, which would recompile the program for every new
process; instead the agent attaches plain uprobes at the probe addresses, increments each
probe's semaphore in the process (the guarded code path runs only while it is non-zero), and
hands the argument locations to the BPF program through its config map.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from argus.probes.records import USDT_ARG_CONST, USDT_ARG_MEM, USDT_ARG_NONE, USDT_ARG_REG, UsdtArg

# x86-64 register name -> word index in the kernel's struct pt_regs
_REGS: Dict[str, int] = {}
for _idx, _names in {
    0: "r15 r15d r15w r15b",
    1: "r14 r14d r14w r14b",
    2: "r13 r13d r13w r13b",
    3: "r12 r12d r12w r12b",
    4: "rbp ebp bp bpl",
    5: "rbx ebx bx bl",
    6: "r11 r11d r11w r11b",
    7: "r10 r10d r10w r10b",
    8: "r9 r9d r9w r9b",
    9: "r8 r8d r8w r8b",
    10: "rax eax ax al",
    11: "rcx ecx cx cl",
    12: "rdx edx dx dl",
    13: "rsi esi si sil",
    14: "rdi edi di dil",
    16: "rip eip ip",
    19: "rsp esp sp spl",
}.items():
    for _n in _names.split():
        _REGS[_n] = _idx

_ARG = re.compile(r"^(-?\d+)@(?:%(\w+)|(-?\d*)\(%(\w+)\)|\$(-?\d+))$")


@dataclass(frozen=True)
class UsdtProbe:
    provider: str
    name: str
    pc: int  # virtual address of the probe site
    semaphore: int  # virtual address of the semaphore, 0 if none
    args: Tuple[str, ...]


def parse_arg(spec: str) -> Optional[UsdtArg]:
    """'-4@112(%rsp)', '-8@%r12', '4@$1' -> UsdtArg (None when not understood)."""
    m = _ARG.match(spec.strip())
    if not m:
        return None
    size = int(m.group(1))
    a = UsdtArg(kind=USDT_ARG_NONE, reg=0, size=abs(size), is_signed=1 if size < 0 else 0, offset=0)
    if abs(size) not in (1, 2, 4, 8):
        return None
    if m.group(5) is not None:
        a.kind, a.offset = USDT_ARG_CONST, int(m.group(5))
        return a
    reg = m.group(2) or m.group(4)
    if reg not in _REGS:
        return None
    a.reg = _REGS[reg]
    if m.group(2):
        a.kind = USDT_ARG_REG
    else:
        a.kind, a.offset = USDT_ARG_MEM, int(m.group(3) or 0)
    return a


def probes(path: str) -> List[UsdtProbe]:
    """Every stapsdt note of an ELF64 little-endian file (empty when there are none)."""
    with open(path, "rb") as f:
        eh = f.read(64)
        if len(eh) < 64 or eh[:4] != b"\x7fELF" or eh[4] != 2:
            return []
        (shoff,) = struct.unpack_from("<Q", eh, 40)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", eh, 58)
        f.seek(shoff)
        raw = f.read(shentsize * shnum)
        secs = [struct.unpack_from("<IIQQQQIIQQ", raw, i * shentsize) for i in range(shnum)]
        if not secs or shstrndx >= len(secs):
            return []
        f.seek(secs[shstrndx][4])
        names = f.read(secs[shstrndx][5])

        def sec_name(s: tuple) -> str:
            end = names.find(b"\0", s[0])
            return names[s[0] : end].decode(errors="replace")

        by_name = {sec_name(s): s for s in secs}
        note, base_sec = by_name.get(".note.stapsdt"), by_name.get(".stapsdt.base")
        if note is None:
            return []
        f.seek(note[4])
        data = f.read(note[5])
    actual_base = base_sec[3] if base_sec is not None else 0
    out: List[UsdtProbe] = []
    off = 0
    while off + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, off)
        off += 12
        name = data[off : off + namesz]
        off += (namesz + 3) & ~3
        desc = data[off : off + descsz]
        off += (descsz + 3) & ~3
        if ntype != 3 or not name.startswith(b"stapsdt") or len(desc) < 24:
            continue
        pc, base, sem = struct.unpack_from("<QQQ", desc, 0)
        provider, pname, args = [*desc[24:].split(b"\0"), b"", b"", b""][:3]
        adjust = actual_base - base if actual_base and base else 0
        out.append(
            UsdtProbe(
                provider.decode(errors="replace"),
                pname.decode(errors="replace"),
                pc + adjust,
                sem + adjust if sem else 0,
                tuple(args.decode(errors="replace").split()),
            )
        )
    return out


def find(path: str, provider: str, name: str) -> Optional[UsdtProbe]:
    try:
        return next((p for p in probes(path) if p.provider == provider and p.name == name), None)
    except OSError:
        return None


def adjust_semaphore(pid: int, addr: int, delta: int) -> bool:
    """Add `delta` to a probe's 16-bit semaphore in process `pid` (True when written)."""
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as f:
            f.seek(addr)
            cur = struct.unpack("<H", f.read(2))[0]
            f.seek(addr)
            f.write(struct.pack("<H", max(0, min(0xFFFF, cur + delta))))
        return True
    except (OSError, struct.error, ValueError, OverflowError):
        return False
