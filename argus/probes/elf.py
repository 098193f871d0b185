"""A small ELF64 reader: exported symbols, their file offsets, and the bytes there.

Enough to resolve uprobe targets ourselves (bcc re-parses a library per attach, which is slow
for a 344 MB libnccl) and to read each function's first instructions.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Tuple

SHT_SYMTAB = 2
SHT_RELA = 4
SHT_DYNSYM = 11
STT_OBJECT = 1
STT_FUNC = 2
STT_GNU_IFUNC = 10
PT_LOAD = 1
# x86-64 relocations that fill a pointer slot
R_X86_64_64 = 1
R_X86_64_GLOB_DAT = 6
R_X86_64_JUMP_SLOT = 7
R_X86_64_RELATIVE = 8


class ElfError(ValueError):
    pass


@dataclass(frozen=True)
class Symbol:
    name: str
    vaddr: int
    size: int
    offset: int  # file offset: what a uprobe attaches to


class Elf:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF":
                raise ElfError(f"{self.path} is not an ELF file")
            if ident[4] != 2 or ident[5] != 1:
                raise ElfError(f"{self.path} is not a little-endian ELF64 file")
            (
                self.type,
                _machine,
                _ver,
                _entry,
                phoff,
                shoff,
                _flags,
                _ehsize,
                phentsize,
                phnum,
                shentsize,
                shnum,
                _shstrndx,
            ) = struct.unpack_from("<HHIQQQIHHHHHH", ident, 16)
            self._loads = self._read_loads(f, phoff, phentsize, phnum)
            self.data_symbols: Dict[str, Symbol] = {}
            self._sections: List[Tuple[int, ...]] = []
            self._dynsym_values: List[int] = []  # st_value by .dynsym index (0: undefined)
            self.symbols = self._read_symbols(f, shoff, shentsize, shnum)
        self._relocs: Optional[Dict[int, Tuple[int, int, int]]] = None

    @staticmethod
    def _read_loads(f: BinaryIO, phoff: int, entsize: int, num: int) -> List[Tuple[int, int, int]]:
        f.seek(phoff)
        raw = f.read(entsize * num)
        loads = []
        for i in range(num):
            p_type, _pflags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _align = struct.unpack_from(
                "<IIQQQQQQ", raw, i * entsize
            )
            if p_type == PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
        return loads

    def _read_symbols(self, f: BinaryIO, shoff: int, entsize: int, num: int) -> Dict[str, Symbol]:
        f.seek(shoff)
        raw = f.read(entsize * num)
        sections = [struct.unpack_from("<IIQQQQIIQQ", raw, i * entsize) for i in range(num)]
        self._sections = sections
        out: Dict[str, Symbol] = {}
        # .symtab first, then .dynsym wins: exported names are what callers bind to
        for want in (SHT_SYMTAB, SHT_DYNSYM):
            for (
                _name,
                sh_type,
                _fl,
                _addr,
                sh_offset,
                sh_size,
                sh_link,
                _info,
                _align,
                sh_entsize,
            ) in sections:
                if sh_type != want or sh_entsize == 0:
                    continue
                strtab = sections[sh_link]
                f.seek(strtab[4])
                strs = f.read(strtab[5])
                f.seek(sh_offset)
                data = f.read(sh_size)
                for j in range(sh_size // sh_entsize):
                    st_name, st_info, _other, st_shndx, st_value, st_size = struct.unpack_from(
                        "<IBBHQQ", data, j * sh_entsize
                    )
                    if want == SHT_DYNSYM:
                        self._dynsym_values.append(st_value if st_shndx != 0 else 0)
                    kind = st_info & 0xF
                    if st_shndx == 0 or st_value == 0 or kind not in (STT_FUNC, STT_GNU_IFUNC, STT_OBJECT):
                        continue
                    end = strs.find(b"\0", st_name)
                    name = strs[st_name:end].decode(errors="replace").split("@", 1)[0]
                    sym = Symbol(name, st_value, st_size, self.vaddr_to_offset(st_value))
                    (self.data_symbols if kind == STT_OBJECT else out)[name] = sym
        return out

    def vaddr_to_offset(self, vaddr: int) -> int:
        for p_vaddr, p_offset, p_filesz in self._loads:
            if p_vaddr <= vaddr < p_vaddr + p_filesz:
                return vaddr - p_vaddr + p_offset
        return vaddr

    def offset_to_vaddr(self, offset: int) -> Optional[int]:
        for p_vaddr, p_offset, p_filesz in self._loads:
            if p_offset <= offset < p_offset + p_filesz:
                return offset - p_offset + p_vaddr
        return None

    def _relocations(self) -> Dict[int, Tuple[int, int, int]]:
        """slot vaddr -> (type, .dynsym index, addend) of every RELA entry (read once, on demand)."""
        if self._relocs is None:
            self._relocs = {}
            with open(self.path, "rb") as f:
                for sec in self._sections:
                    if sec[1] != SHT_RELA or sec[9] != 24:
                        continue
                    f.seek(sec[4])
                    for r_offset, r_info, r_addend in struct.iter_unpack(
                        "<QQq", f.read(sec[5] - sec[5] % 24)
                    ):
                        self._relocs[r_offset] = (r_info & 0xFFFFFFFF, r_info >> 32, r_addend)
        return self._relocs

    def pointer_at(self, vaddr: int) -> Optional[int]:
        """The vaddr (in this file) that the dynamic loader stores in the pointer slot at `vaddr`, when
        its relocation says so without another library: relative, or a symbol this file defines."""
        rel = self._relocations().get(vaddr)
        if rel is None:
            return None
        rtype, sym, addend = rel
        if rtype == R_X86_64_RELATIVE:
            return addend
        if rtype in (R_X86_64_64, R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT) and 0 < sym < len(
            self._dynsym_values
        ):
            value = self._dynsym_values[sym]
            return value + (addend if rtype == R_X86_64_64 else 0) if value else None
        return None

    def read(self, offset: int, n: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(n)
