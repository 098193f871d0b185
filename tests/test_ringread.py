"""The agent's ring buffer reader (argus/agent/ringread.py) against a real BPF ring buffer: every
committed record once, in order, across the wrap of the ring and over many reads; discarded ones
skipped; none lost while the ring is never full; records of different sizes."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import List, Tuple

import pytest

from argus.agent.ringread import RingReader

pytestmark = pytest.mark.bpf

PAGES = 1  # 4 KiB: a few hundred records fill it, so the test wraps it many times

PROG = r"""
#include <uapi/linux/ptrace.h>
BPF_RINGBUF_OUTPUT(ring, PAGES);
BPF_ARRAY(next, u64, 1);
struct small { u64 seq; };
struct big { u64 seq; u64 pad[5]; };
int emit(struct pt_regs *ctx) {
    if (bpf_get_current_pid_tgid() >> 32 != TGID) return 0;  /* getpid: every process calls it */
    int z = 0;
    u64 *n = next.lookup(&z);
    if (!n) return 0;
    for (int i = 0; i < 8; i++) {
        u64 seq = __sync_fetch_and_add(n, 1);
        if (seq % 3 == 0) {
            struct big *b = ring.ringbuf_reserve(sizeof(struct big));
            if (!b) return 0;
            b->seq = seq;
            if (seq % 7 == 0) { ring.ringbuf_discard(b, 0); continue; }
            ring.ringbuf_submit(b, BPF_RB_NO_WAKEUP);
        } else {
            struct small *s = ring.ringbuf_reserve(sizeof(struct small));
            if (!s) return 0;
            s->seq = seq;
            ring.ringbuf_submit(s, BPF_RB_NO_WAKEUP);
        }
    }
    return 0;
}
"""


def test_every_committed_record_once_in_order_across_the_wrap() -> None:
    from bcc import BPF

    b = BPF(text=PROG, cflags=[f"-DTGID={os.getpid()}", f"-DPAGES={PAGES}"])
    try:
        b.attach_uprobe(name="c", sym="getpid", fn_name="emit")
        reader = RingReader(b["ring"].map_fd, PAGES * mmap.PAGESIZE)
        got: List[Tuple[int, int]] = []

        def on(buf: mmap.mmap, off: int, size: int) -> None:
            got.append((struct.unpack_from("<Q", buf, off)[0], size))

        libc = ctypes.CDLL("libc.so.6")
        for _ in range(400):  # 3,200 records of 8 or 48 bytes through a 4 KiB ring
            for _ in range(4):
                libc.getpid()  # 32 records, < 1 KiB: the ring does not fill between reads
            reader.read(on)
        reader.read(on)
        reader.close()
        emitted = int(b["next"][ctypes.c_int(0)].value)  # the process calls getpid itself too
    finally:
        b.cleanup()
    assert emitted >= 3200
    want = [(s, 48 if s % 3 == 0 else 8) for s in range(emitted) if not (s % 3 == 0 and s % 7 == 0)]
    assert got == want
    assert reader.records == len(want)


def test_the_reader_refuses_a_size_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        RingReader(-1, 3 * 4096)
