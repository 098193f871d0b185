"""A Python thread's stack read from outside the process: its frame chain walked with the
interpreter's offsets, each frame's current line from its code object's line table and
instruction pointer (CPython 3.9-3.13: lnotab, the 3.10 table, PEP 657's; "def line N", the
function's first line, when the table or pointer cannot be read). Bounded reads; a thread that
vanishes yields what was read. Used by argus/agent/threadscan.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from argus.probes.cpython import CodeResolver, Interpreter, Mem, ThreadReader
from argus.probes.cpython_offsets import NONE

MAX_PY_FRAMES = 64
PY_OWNED_BY_CSTACK = 3  # enum _frameowner, 3.12 and 3.13: C-stack shim frames, skipped


# ---- Python frames --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineOffsets:
    """Where the current instruction and the line table are (x86-64; tests/test_threadscan.py
    recompiles the table against each interpreter's headers)."""

    kind: str  # line table format: "lnotab" (3.9), "linetable310", "pep657" (3.11+)
    frame_instr: int  # prev_instr / instr_ptr pointer (3.11+), or int f_lasti (3.9, 3.10)
    frame_lineno: int  # int f_lineno, valid when non-zero (3.10); NONE otherwise
    code_linetable: int  # co_lnotab (3.9) / co_linetable
    code_adaptive: int  # co_code_adaptive (3.11+); NONE before
    code_size: int = 16  # ob_size: code units (3.11+)
    bytes_size: int = 16
    bytes_data: int = 32


LINE_OFFSETS: Dict[Tuple[int, int], LineOffsets] = {
    (3, 9): LineOffsets("lnotab", 104, NONE, 120, NONE),
    (3, 10): LineOffsets("linetable310", 96, 100, 120, NONE),
    (3, 11): LineOffsets("pep657", 56, NONE, 136, 184),
    (3, 12): LineOffsets("pep657", 56, NONE, 136, 192),
    (3, 13): LineOffsets("pep657", 56, NONE, 136, 200),
}
_LINE_TABLE_MAX = 1 << 18


def _signed8(b: int) -> int:
    return b - 256 if b > 127 else b


def line_lnotab(table: bytes, first: int, addr: int) -> Optional[int]:
    """3.9 co_lnotab: (byte increment, line increment) pairs; `addr` in bytes."""
    line, a = first, 0
    for i in range(0, len(table) - 1, 2):
        a += table[i]
        if a > addr:
            break
        line += _signed8(table[i + 1])
    return line


def line_310(table: bytes, first: int, addr: int) -> Optional[int]:
    """3.10 co_linetable: (byte length, line delta or -128 for none) pairs; `addr` in bytes."""
    if addr < 0:
        return first
    line, end = first, 0
    for i in range(0, len(table) - 1, 2):
        start, end = end, end + table[i]
        delta = _signed8(table[i + 1])
        if delta != -128:
            line += delta
        if start <= addr < end:
            return None if delta == -128 else line
    return None


def line_pep657(table: bytes, first: int, addr: int) -> Optional[int]:
    """3.11+ location table (CPython Objects/locations.md): entries of a first byte 1CCCCLLL (code,
    length-1 in code units) and continuation bytes below 0x80; `addr` in bytes."""
    if addr < 0:
        return first
    line, pos, i, n = first, 0, 0, len(table)
    while i < n:
        b = table[i]
        if not b & 0x80:
            return None
        code, end = (b >> 3) & 15, pos + ((b & 7) + 1) * 2
        i += 1
        if code in (13, 14):  # no-column and long forms: a signed varint line delta
            val, shift = 0, 0
            while i < n:
                c = table[i]
                i += 1
                val |= (c & 63) << shift
                shift += 6
                if not c & 64:
                    break
            line += -(val >> 1) if val & 1 else val >> 1
        elif code in (10, 11, 12):  # one-line forms
            line += code - 10
        if pos <= addr < end:
            return None if code == 15 else line
        pos = end
        while i < n and not table[i] & 0x80:
            i += 1
    return None


class _PyWalker:
    """Frame chains and current lines of one interpreter's threads, from /proc/PID/mem."""

    def __init__(self, interp: Interpreter, mem: Mem) -> None:
        self.interp, self.mem = interp, mem
        self.o = interp.offsets
        self.lo = LINE_OFFSETS.get(interp.version)
        fields = [self.o.frame_code + 8, self.o.frame_back + 8, self.o.frame_owner + 1]
        if self.lo is not None:
            fields += [self.lo.frame_instr + 8, self.lo.frame_lineno + 4]
        self.frame_read = max(fields)
        self.codes = CodeResolver(interp)
        self.tables: Dict[int, Optional[bytes]] = {}

    def frames(self, tstate: int) -> List[Tuple[int, int, int]]:
        """(code, instruction field, f_lineno) per frame, innermost first."""
        o, mem = self.o, self.mem
        frame = mem.u64(tstate + o.tstate_frame)
        if frame and o.cframe_frame != NONE:
            frame = mem.u64(frame + o.cframe_frame)
        out: List[Tuple[int, int, int]] = []
        for _ in range(MAX_PY_FRAMES * 2):  # shim frames count against the bound too
            if not frame or len(out) >= MAX_PY_FRAMES:
                break
            raw = mem.read(frame, self.frame_read)
            if raw is None:
                break
            code, back = (struct.unpack_from("<Q", raw, off)[0] for off in (o.frame_code, o.frame_back))
            if o.frame_owner == NONE or raw[o.frame_owner] != PY_OWNED_BY_CSTACK:
                instr, lineno = 0, 0
                if self.lo is not None:
                    fmt = "<Q" if self.lo.code_adaptive != NONE else "<i"
                    instr = struct.unpack_from(fmt, raw, self.lo.frame_instr)[0]
                    if self.lo.frame_lineno != NONE:
                        lineno = struct.unpack_from("<i", raw, self.lo.frame_lineno)[0]
                out.append((code, instr, lineno))
            frame = back
        return out

    def _table(self, code: int) -> Optional[bytes]:
        if code not in self.tables:
            assert self.lo is not None
            obj = self.mem.u64(code + self.lo.code_linetable)
            size = self.mem.u64(obj + self.lo.bytes_size) if obj else None
            if not obj or size is None or size > _LINE_TABLE_MAX:
                self.tables[code] = None
            else:  # an empty table is valid: every instruction is on the first line
                self.tables[code] = self.mem.read(obj + self.lo.bytes_data, size) if size else b""
        return self.tables[code]

    def line(self, code: int, instr: int, lineno: int, first: int) -> Optional[int]:
        """The frame's current line, as PyFrame_GetLineNumber computes it; None when unknown."""
        lo = self.lo
        if lo is None:
            return None
        if lineno > 0:
            return lineno
        table = self._table(code)
        if table is None:
            return None
        if lo.kind == "lnotab":
            return line_lnotab(table, first, instr)
        if lo.kind == "linetable310":
            return line_310(table, first, instr * 2)
        units = self.mem.u64(code + lo.code_size)
        addr = (instr - (code + lo.code_adaptive)) // 2 * 2  # LASTI in code units, as bytes
        if units is None or not -2 <= addr < units * 2:
            return None
        return line_pep657(table, first, addr)

    def stack(self, tstate: int) -> Tuple[str, ...]:
        frames = self.frames(tstate)
        out = []
        for (code, instr, lineno), f in zip(frames, self.codes.resolve([c for c, _, _ in frames])):
            if f.qualname in ("<unreadable>", "<not code>"):
                break  # a racing or torn chain: what came before is still good
            line = self.line(code, instr, lineno, f.line)
            out.append(
                f"{f.qualname} ({f.filename}:{line})"
                if line
                else f"{f.qualname} ({f.filename}, def line {f.line})"
            )
        return tuple(out)


def python_stacks(interp: Interpreter, tids: Sequence[int]) -> Dict[int, Tuple[str, ...]]:
    tstates = ThreadReader(interp).threads()
    mem = Mem(interp.pid)
    try:
        walker = _PyWalker(interp, mem)
        return {tid: walker.stack(tstates[tid]) for tid in tids if tid in tstates}
    finally:
        mem.close()
