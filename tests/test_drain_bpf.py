"""The drains' batch reads and deletes (argus/agent/drain.py) on real BPF hash maps: every entry
read whatever the chunking, only the chosen keys deleted, a key already gone no error."""

from __future__ import annotations

import ctypes

import pytest

from argus.agent import drain

pytestmark = pytest.mark.bpf

SRC = """
struct k { u32 tgid; u32 pad; u64 epoch; };
BPF_HASH(structs, struct k, u64, 8192);
BPF_HASH(plain, u32, u64, 64);
"""


@pytest.fixture(scope="module")
def bpf():  # type: ignore[no-untyped-def]
    from bcc import BPF

    b = BPF(text=SRC)
    yield b
    b.cleanup()


def test_batch_read_sees_every_entry_and_deletes_only_the_chosen(
    bpf,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setattr(drain, "BATCH_CHUNK", 100)  # many chunks, and buckets across chunk ends
    tbl = bpf["structs"]
    tbl.clear()
    for i in range(3000):
        tbl[tbl.Key(tgid=i % 7, epoch=i)] = ctypes.c_uint64(i * 3)
    got = drain.entries(tbl)
    assert sorted((int(k.epoch), int(v.value)) for k, v in got) == [(i, i * 3) for i in range(3000)]
    assert tbl.map_fd not in drain._no_batch  # the batch path ran, not bcc's per-key fallback
    even = [k for k, _ in got if k.epoch % 2 == 0]
    drain.delete(tbl, [*even[:10], tbl.Key(tgid=99, epoch=1), *even[10:]])  # a key not there
    assert sorted(int(k.epoch) for k in tbl.keys()) == list(range(1, 3000, 2))


def test_plain_values_come_back_as_ctypes_objects(bpf) -> None:  # type: ignore[no-untyped-def]
    tbl = bpf["plain"]
    for i in range(5):
        tbl[ctypes.c_uint32(i)] = ctypes.c_uint64(10 + i)
    got = sorted((k.value, v.value) for k, v in drain.entries(tbl))  # .value, as bcc's items() give
    assert got == [(i, 10 + i) for i in range(5)]
    drain.delete(tbl, [k for k, _ in drain.entries(tbl)])
    assert len(list(tbl.keys())) == 0


def test_an_empty_map_reads_empty(bpf) -> None:  # type: ignore[no-untyped-def]
    tbl = bpf["structs"]
    tbl.clear()
    assert drain.entries(tbl) == []
