"""argus.probes.nccl_layout on NVIDIA's own libnccl.so.2 from five pip wheels (190–430 MB each on
disk, downloaded once into the wheel cache, see tests/nvidia_wheels.py): the accessors decode to
the table row's offsets, the row's build id is the library's, DWARF agrees (with pyelftools), and
resolve_layout picks the row."""

from __future__ import annotations

import time
from typing import Iterator, List

import pytest

from argus.probes import nccl_layout as nl
from argus.probes.elf import Elf
from argus.probes.libnccl import version_of
from tests.nvidia_wheels import Wheel, fetch

pytestmark = pytest.mark.slow

LIB = "nvidia/nccl/lib/libnccl.so.2"
# pinned: cached_path() puts each under its own "nvidia-nccl-cuXX==V" directory
WHEELS = [
    Wheel("nvidia-nccl-cu12==2.18.1", LIB, 210),
    Wheel("nvidia-nccl-cu12==2.21.5", LIB, 190),
    Wheel("nvidia-nccl-cu12==2.27.5", LIB, 320),
    Wheel("nvidia-nccl-cu13==2.28.3", LIB, 195),
    Wheel("nvidia-nccl-cu13==2.32.3", LIB, 305),
]
HEADER = (
    f"{'wheel':26} {'version':>7} {'build id':12} {'commHash':>8} {'rank':>8} {'nRanks':>8} {'cudaDev':>8}"
)
SEEN: List[str] = []


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    if SEEN:  # the whole table once, after the last wheel (`-s` shows it; `-rA` as teardown output)
        print("\n" + "\n".join([HEADER, *SEEN]))


@pytest.mark.parametrize("wheel", WHEELS, ids=lambda w: w.package.replace("nvidia-nccl-", ""))
def test_wheel_layout(wheel: Wheel) -> None:
    path, why = fetch(wheel)
    if path is None:
        pytest.skip(why)
    elf = Elf(path)
    version = version_of(elf)
    bid = nl.build_id(str(path))
    assert bid is not None, "NVIDIA builds carry a GNU build id"
    t0 = time.perf_counter()
    acc = nl.decode_accessors(elf)
    decode_ms = (time.perf_counter() - t0) * 1000
    rows = [r for r in nl.TABLE if r.build_id == bid]
    assert len(rows) == 1, f"{wheel.package}: no table row for build id {bid}"
    row = rows[0]
    assert row.version == version
    assert wheel.package.split("==")[1] == nl.version_str(version)
    assert (acc.rank, acc.nranks, acc.cuda_dev) == (row.rank, row.nranks, row.cuda_dev), acc.notes
    assert acc.notes == ()
    dwarf = "no pyelftools"
    try:
        import elftools  # noqa: F401
    except ImportError:
        pass
    else:
        derived, size = nl.derive(str(path), label=row.label)
        assert derived.__class__(**{**derived.__dict__, "derived": row.derived}) == row
        dwarf = f"DWARF agrees, sizeof {size}"
    res = nl.resolve_layout(elf, version, acc)
    assert res.source == "table" and res.row is row, res.note
    assert (res.comm_hash, res.rank, res.nranks, res.cuda_dev) == (
        row.comm_hash,
        row.rank,
        row.nranks,
        row.cuda_dev,
    )
    line = (
        f"{wheel.package.replace('nvidia-nccl-', ''):26} {version:>7} {bid[:12]:12} {res.comm_hash:>8} "
        f"{res.rank:>8} {res.nranks:>8} {res.cuda_dev:>8}  decode {decode_ms:.0f} ms, {dwarf}"
    )
    SEEN.append(line)
    print(f"\n{HEADER}\n{line}")  # `-rA` carries each test's line in its captured output
