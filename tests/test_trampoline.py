"""Dispatch-stub recognition (argus/probes/trampoline.py) on hand-assembled byte sequences.

The real library's stubs are checked in tests/test_real_nvidia.py; these pin down what counts as a
stub (only compares, tests, branches and a narrow argument's zero-extension before `jmp *slot`) and
what does not (anything that writes memory or an argument register).
"""

from __future__ import annotations

import struct

import pytest

from argus.probes.trampoline import stub_slot


def rip(disp: int) -> bytes:
    return struct.pack("<i", disp)


VADDR = 0x32F860
# NVIDIA 535's cuLaunchKernel: cmpl $0x321cba00,0x18d933e(%rip); je +0xc; jmp *0x17e18c6(%rip)
NVIDIA = (
    bytes.fromhex("813d3e938d0100ba1c32")
    + b"\x74\x0c"
    + b"\xff\x25"
    + rip(0x17E18C6)
    + b"\x66\x0f\x1f\x44\x00\x00"
)


def test_nvidia_stub_slot_is_the_jump_target_of_its_rip_relative_jmp() -> None:
    assert stub_slot(NVIDIA, VADDR) == VADDR + 12 + 6 + 0x17E18C6 == 0x1B11138  # as objdump decodes it


@pytest.mark.parametrize(
    "code, at",
    [
        (b"\xff\x25" + rip(0x100), 0),  # a PLT-like stub: jmp at once
        (b"\xf3\x0f\x1e\xfa" + b"\xff\x25" + rip(0x100), 4),  # endbr64 first
        (b"\xf3\x0f\x1e\xfa\x3e\xff\x25" + rip(0x100), 5),  # notrack jmp
        (
            bytes.fromhex("813d11223344")
            + b"\x00\xba\x1c\x32"
            + b"\x0f\x84"
            + rip(8)
            + b"\xff\x25"
            + rip(0x100),
            16,
        ),
        (b"\x40\x0f\xb6\xf6" + b"\xff\x25" + rip(0x100), 4),  # movzbl %sil,%esi (cuMemsetD8_v2's stub)
        (b"\x48\x83\x3d" + rip(0x40) + b"\x00" + b"\x75\x02" + b"\xff\x25" + rip(0x100), 10),  # cmpq $0 + jne
    ],
)
def test_shapes_that_only_read_before_the_jump_are_stubs(code: bytes, at: int) -> None:
    assert stub_slot(code, 0x1000) == 0x1000 + at + 6 + 0x100


@pytest.mark.parametrize(
    "code",
    [
        b"\x55\x48\x89\xe5",  # push %rbp; mov %rsp,%rbp: an ordinary function
        b"\x80\x05" + rip(0x40) + b"\x01" + b"\xff\x25" + rip(0x100),  # addb $1,(rip): writes memory
        b"\x48\x89\xf7" + b"\xff\x25" + rip(0x100),  # mov %rsi,%rdi: changes an argument
        b"\x0f\xb6\xf7" + b"\xff\x25" + rip(0x100),  # movzbl %bh,%esi: another register into an argument
        b"\xff\x25\x00",  # cut short
        b"\x90" * 60 + b"\xff\x25" + rip(0x100),  # too far in to be a stub
        b"",
    ],
)
def test_anything_that_writes_or_computes_is_not_a_stub(code: bytes) -> None:
    assert stub_slot(code, 0x1000) is None
