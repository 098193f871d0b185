"""argus.probes.nccl_layout on libraries built here: the simulator's libnccl, and small C files that
mimic NVIDIA's accessors (argument checks, calls, an NVTX-like range object) or a fork that claims
NCCL 2.21.5 with a different struct. Needs only gcc and objdump (binutils)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

import pytest

from argus.probes import nccl_layout as nl
from argus.probes.elf import Elf
from argus.probes.libnccl import version_of
from argus.sim.build import CSRC, build

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or shutil.which("objdump") is None, reason="needs gcc and objdump (binutils)"
)

SIM_ROW = next(r for r in nl.TABLE if r.label == "argus simulator (any build)")
NVIDIA_2215 = next(r for r in nl.TABLE if r.version == 22105 and r.build_id is not None)

# An accessor shaped like NVIDIA's: a scoped range whose address escapes, three checks (calls)
# that can fail, then `*out = comm->field`. RANK/NRANKS/CUDADEV place the fields.
FAKE = r"""
#include <stdint.h>
#include <stddef.h>
#ifdef __cplusplus
#define API extern "C" __attribute__((visibility("default")))
#else
#define API __attribute__((visibility("default")))
#endif
struct ncclComm {
    uint64_t magic;
    char pad[RANK - 16];
    uint64_t commHash;
    int rank;            /* RANK */
    char pad2[NRANKS - RANK - 4];
    int nRanks;          /* NRANKS */
    char pad3[CUDADEV - NRANKS - 4];
    int cudaDev;         /* CUDADEV */
    int state;
};
struct range { const char *name; int depth; };
#define NOINLINE __attribute__((noinline))
NOINLINE void range_push(struct range *r, const char *n) { r->name = n; __asm__ volatile("" ::: "memory"); }
NOINLINE void range_pop(struct range *r) { r->depth--; __asm__ volatile("" ::: "memory"); }
NOINLINE int CommCheck(struct ncclComm *c, const char *f) { return !c || c->magic != 0x1234 ? 4 : 0; }
NOINLINE int PtrCheck(void *p, const char *f) { return p ? 0 : 4; }
NOINLINE int EnsureReady(struct ncclComm *c) { return c->state < 0 ? 5 : 0; }
#define ACCESSOR(fn, field)                                        \
API int fn(struct ncclComm *comm, int *out) {                      \
    struct range r; range_push(&r, #fn);                           \
    int res = CommCheck(comm, #fn);                                \
    if (res) goto end;                                             \
    res = PtrCheck(out, #fn);                                      \
    if (res) goto end;                                             \
    res = EnsureReady(comm);                                       \
    if (res) goto end;                                             \
    *out = comm->field;                                            \
end:                                                               \
    range_pop(&r);                                                 \
    return res;                                                    \
}
ACCESSOR(ncclCommUserRank, rank)
ACCESSOR(ncclCommCount, nRanks)
ACCESSOR(ncclCommCuDevice, cudaDev)
API int ncclGetVersion(int *v) { if (!v) return 4; *v = 22105; return 0; }
"""

VERSION_ONLY = r"""
__attribute__((visibility("default"))) int ncclGetVersion(int *v) { if (!v) return 4; *v = 22105; return 0; }
__attribute__((visibility("default"))) int ncclAllReduce(void) { return 0; }
"""


def cc(tmp: Path, name: str, source: str, flags: List[str], lang: str = "c") -> Path:
    src = tmp / f"{name}.{'cc' if lang == 'c++' else 'c'}"
    src.write_text(source)
    out = tmp / f"lib{name}.so"
    compiler = "g++" if lang == "c++" else "gcc"
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    cmd = [compiler, "-x", lang, "-shared", "-fPIC", *flags, "-o", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def fake(
    tmp: Path, name: str, rank: int, nranks: int, cuda_dev: int, flags: List[str], lang: str = "c"
) -> Path:
    defs = [f"-DRANK={rank}", f"-DNRANKS={nranks}", f"-DCUDADEV={cuda_dev}"]
    return cc(tmp, name, FAKE, [*flags, *defs], lang)


def resolve(path: Path) -> nl.Resolved:
    elf = Elf(path)
    return nl.resolve_layout(elf, version_of(elf))


# --------------------------------------------------------------------------- the simulator


@pytest.fixture(scope="module")
def sim_lib() -> Path:
    return build().libnccl


def test_simulator_accessors_decode(sim_lib: Path) -> None:
    acc = nl.decode_accessors(Elf(sim_lib))
    assert (acc.rank, acc.nranks, acc.cuda_dev) == (16, 20, 24), acc.notes
    assert acc.notes == ()


def test_simulator_resolves_to_its_fingerprint_row(sim_lib: Path) -> None:
    res = resolve(sim_lib)
    assert res.source == "table", res.note
    assert res.row is SIM_ROW
    assert (res.comm_hash, res.rank, res.nranks, res.cuda_dev) == (8, 16, 20, 24)
    assert "fingerprint" in res.note


@pytest.mark.parametrize(
    "flags",
    [
        ["-O0"],
        ["-O0", "-fomit-frame-pointer"],
        ["-O2"],
        ["-O2", "-fomit-frame-pointer", "-s"],
        ["-O2", "-fno-omit-frame-pointer", "-fcf-protection=branch"],
        ["-Os", "-s"],  # keeps comm in %rdi across a call to a leaf check (GCC's -fipa-ra)
        ["-O3", "-s"],
    ],
    ids=" ".join,
)
def test_simulator_source_decodes_the_same_at_any_optimisation(tmp_path: Path, flags: List[str]) -> None:
    src = (CSRC / "nccl.c").read_text()
    lib = cc(tmp_path, "simnccl", src, [*flags, "-pthread", f"-I{CSRC}"])
    acc = nl.decode_accessors(Elf(lib))
    assert (acc.rank, acc.nranks, acc.cuda_dev) == (16, 20, 24), acc.notes


# --------------------------------------------------------------------------- NVIDIA-shaped accessors


@pytest.mark.parametrize("lang", ["c", "c++"])
@pytest.mark.parametrize(
    "flags",
    [
        ["-O0"],
        ["-O0", "-fomit-frame-pointer", "-s"],
        ["-O2"],
        ["-O2", "-fomit-frame-pointer", "-s"],
        ["-O2", "-fno-omit-frame-pointer"],
    ],
    ids=" ".join,
)
def test_nvidia_shaped_accessors_decode_at_O0_and_O2(tmp_path: Path, flags: List[str], lang: str) -> None:
    # fields a megabyte into the struct, as in NCCL 2.27+: 32-bit displacements
    lib = fake(tmp_path, "fakenccl", 1066168, 1066172, 1066176, flags, lang)
    acc = nl.decode_accessors(Elf(lib))
    assert (acc.rank, acc.nranks, acc.cuda_dev) == (1066168, 1066172, 1066176), acc.notes


# --------------------------------------------------------------------------- resolving


def test_a_fork_claiming_2_21_5_with_another_struct_gets_its_accessor_offsets(tmp_path: Path) -> None:
    lib = fake(tmp_path, "fork", 40, 44, 48, ["-O2", "-s", "-fomit-frame-pointer"])
    elf = Elf(lib)
    assert version_of(elf) == 22105
    res = nl.resolve_layout(elf, 22105)
    assert res.source == "accessors", res.note
    assert res.row is None and res.comm_hash is None
    assert (res.rank, res.nranks, res.cuda_dev) == (40, 44, 48)
    assert "argus simulator (any build)" in res.note and "rejected" in res.note


def test_nvidia_offsets_without_nvidia_build_id_get_no_commhash(tmp_path: Path) -> None:
    # same rank/nRanks as NVIDIA's 2.21.5, another build: NVIDIA's row is keyed by build id only
    lib = fake(tmp_path, "lookalike", NVIDIA_2215.rank, NVIDIA_2215.nranks, 13544, ["-O2", "-s"])
    res = resolve(lib)
    assert res.source == "accessors", res.note
    assert res.row is None and res.comm_hash is None
    assert (res.rank, res.nranks) == (13536, 13540)


def test_a_library_without_accessors_resolves_to_none(tmp_path: Path) -> None:
    lib = cc(tmp_path, "versiononly", VERSION_ONLY, ["-O2", "-s"])
    elf = Elf(lib)
    assert version_of(elf) == 22105
    acc = nl.decode_accessors(elf)
    assert (acc.rank, acc.nranks, acc.cuda_dev) == (None, None, None)
    assert any("not exported" in n for n in acc.notes)
    res = nl.resolve_layout(elf, 22105, acc)
    assert res.source == "none"
    assert (res.comm_hash, res.rank, res.nranks, res.cuda_dev, res.row) == (None,) * 5
    assert "needs the accessors" in res.note  # the simulator row was a candidate, not trusted


def _row(build_id: Optional[str], rank: int, nranks: int, version: int = 22105) -> nl.LayoutRow:
    return nl.LayoutRow(version, build_id, rank - 8, rank, nranks, None, None, None, "test row", "by hand")


def test_an_exact_build_id_row_is_still_checked_against_the_accessors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = fake(tmp_path, "bid", 40, 44, 48, ["-O2", "-Wl,--build-id=0xabcdef01"])
    assert nl.build_id(str(lib)) == "abcdef01"
    monkeypatch.setattr(nl, "TABLE", (_row("abcdef01", 100, 104),))
    res = resolve(lib)
    assert res.source == "accessors" and res.rank == 40
    assert "accessors decode rank@40, nRanks@44, the row says 100/104" in res.note
    monkeypatch.setattr(nl, "TABLE", (_row("abcdef01", 40, 44),))
    res = resolve(lib)
    assert res.source == "table" and res.comm_hash == 32 and "validated by the accessors" in res.note


def test_undecodable_accessors_trust_only_an_exact_build_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = cc(tmp_path, "nobody", VERSION_ONLY, ["-O2", "-Wl,--build-id=0x5555"])
    monkeypatch.setattr(nl, "TABLE", (_row(None, 40, 44),))
    assert resolve(lib).source == "none"
    monkeypatch.setattr(nl, "TABLE", (_row(None, 40, 44), _row("5555", 40, 44)))
    res = resolve(lib)
    assert res.source == "table" and res.row == _row("5555", 40, 44)
    assert "exact build id" in res.note
    monkeypatch.setattr(nl, "TABLE", (_row("5555", 40, 44, version=22203),))
    assert resolve(lib).source == "none"  # a build-id row for another version is not believed


AMBIGUOUS = r"""
struct ncclComm { long magic; long commHash; int rank; int nRanks; int cudaDev; int flag; int *ranks; };
__attribute__((visibility("default"))) int ncclCommUserRank(struct ncclComm *c, int *out) {
    if (c->flag) *out = c->rank; else *out = c->nRanks;   /* two fields: no answer */
    return 0;
}
__attribute__((visibility("default"))) int ncclCommCount(struct ncclComm *c, int *out) {
    *out = c->ranks[c->rank];                            /* not a field of the comm */
    return 0;
}
__attribute__((visibility("default"))) int ncclCommCuDevice(struct ncclComm *c, int *out) {
    if (!out) return 4;
    *out = -1;                                           /* a constant, then the field */
    if (c) *out = c->cudaDev;
    return 0;
}
"""


@pytest.mark.parametrize("opt", ["-O0", "-O2"])
def test_ambiguous_or_untracked_stores_give_no_offset(tmp_path: Path, opt: str) -> None:
    lib = cc(tmp_path, "ambiguous", AMBIGUOUS, [opt, "-s"])
    acc = nl.decode_accessors(Elf(lib))
    assert acc.rank is None and acc.nranks is None, acc
    rank_note, count_note = acc.notes
    # -O0 stores each field on its own path; -O2 merges them into one store of a cmov/phi result
    assert ("ambiguous: stores of 16, 20" if opt == "-O0" else "untracked") in rank_note
    assert "untracked" in count_note
    assert acc.cuda_dev == 24


def test_build_id(tmp_path: Path, sim_lib: Path) -> None:
    lib = cc(tmp_path, "bid", VERSION_ONLY, ["-Wl,--build-id=0x0123456789abcdef"])
    assert nl.build_id(str(lib)) == "0123456789abcdef"
    none = cc(tmp_path, "nobid", VERSION_ONLY, ["-Wl,--build-id=none"])
    assert nl.build_id(str(none)) is None
    sha1 = nl.build_id(str(sim_lib))
    assert sha1 is not None and len(sha1) == 40


# --------------------------------------------------------------------------- table and CLI


def test_table_rows_are_unambiguous() -> None:
    ids = [r.build_id for r in nl.TABLE if r.build_id is not None]
    assert len(ids) == len(set(ids))
    prints = [(r.version, r.rank, r.nranks) for r in nl.TABLE if r.build_id is None]
    assert len(prints) == len(set(prints))
    for r in nl.TABLE:
        assert r.derived and r.label
        assert len({r.comm_hash, r.rank, r.nranks, r.cuda_dev}) == 4, r
        assert r.build_id is None or len(r.build_id) == 40


def test_show_cli(sim_lib: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert nl.main(["show", str(sim_lib)]) == 0
    out = capsys.readouterr().out
    assert "rank@16 nRanks@20 cudaDev@24" in out
    assert "table: commHash@8" in out


def test_derive_cli_reproduces_the_simulator_row(sim_lib: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("elftools", reason="pyelftools (the dev extra) reads DWARF")
    row, size = nl.derive(str(sim_lib), label=SIM_ROW.label, any_build=True)
    assert row.derived.startswith("python -m argus.probes.nccl_layout derive ")
    assert row.__class__(**{**row.__dict__, "derived": SIM_ROW.derived}) == SIM_ROW
    assert size > 0
    assert nl.main(["derive", "--any-build", str(sim_lib)]) == 0
    assert "comm_hash=8, rank=16, nranks=20, cuda_dev=24" in capsys.readouterr().out


def test_derive_cli_without_dwarf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("elftools", reason="pyelftools (the dev extra) reads DWARF")
    lib = cc(tmp_path, "stripped", VERSION_ONLY, ["-O2", "-s"])
    assert nl.main(["derive", str(lib)]) == 1
    assert capsys.readouterr().out.startswith("error: ")
