"""The stand-in family (tests/standins): libraries written from NVIDIA's public API docs, and jobs
that run on them. These tests check the stand-ins themselves (no BPF): what the libraries export,
that collectives really block, and that faults do what their specs say."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import statistics
import struct
import time
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

from argus.probes import libnccl
from argus.probes.elf import Elf
from tests.standins.build import build
from tests.standins.job import StandinConfig, StandinJob, step_durations_ms
from tests.standins.train import SpecError, parse_fault

pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler (gcc)"),
    pytest.mark.timeout(120),
]

SYS_FUTEX = 202  # x86-64
COMM_NRANKS_OFF, COMM_RANK_OFF = 0x1E8, 0x2F4


@pytest.fixture(scope="module")
def libdir() -> Path:
    return build()


def _section_types(path: Path) -> Set[int]:
    with open(path, "rb") as f:
        head = f.read(64)
        shoff = struct.unpack_from("<Q", head, 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(shoff)
        raw = f.read(shentsize * shnum)
    return {struct.unpack_from("<I", raw, i * shentsize + 4)[0] for i in range(shnum)}


def _median(xs: List[float]) -> float:
    return statistics.median(xs)


def test_libraries_are_stripped_subsets(libdir: Path) -> None:
    cuda, nccl = libdir / "libcuda.so.1", libdir / "libnccl.so.2"
    for lib in (cuda, nccl):
        assert 2 not in _section_types(lib), f"{lib} has a .symtab (not stripped)"
    csyms, nsyms = set(Elf(cuda).symbols), set(Elf(nccl).symbols)
    assert {"cuLaunchKernel", "cuStreamSynchronize", "cuMemcpyHtoDAsync_v2", "cuModuleGetFunction"} <= csyms
    assert not [s for s in csyms if s.startswith("cuEvent")]
    assert {"cuLaunchKernelEx", "cuMemcpyHtoD_v2"}.isdisjoint(csyms)
    assert {"ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclCommInitRank", "ncclSend"} <= nsyms
    assert {"ncclCommSplit", "ncclCommCuDevice", "ncclCommInitRankConfig", "ncclReduce"}.isdisjoint(nsyms)


def test_nccl_version_and_communicator_layout(libdir: Path) -> None:
    nccl = ctypes.CDLL(str(libdir / "libnccl.so.2"))
    v = ctypes.c_int()
    assert nccl.ncclGetVersion(ctypes.byref(v)) == 0 and v.value == 22105
    assert libnccl.version_of(Elf(libdir / "libnccl.so.2")) == 22105  # as the tracer reads it, statically
    # the tracer must not take a table row (e.g. NVIDIA 2.21.5) for our layout; if it decodes the
    # accessors it finds our offsets
    layout = libnccl.layout_of(Elf(libdir / "libnccl.so.2"))
    assert getattr(layout, "source", "none") != "table", layout
    if getattr(layout, "rank", libnccl.OFF_UNKNOWN) != libnccl.OFF_UNKNOWN:
        assert (layout.rank, layout.nranks) == (COMM_RANK_OFF, COMM_NRANKS_OFF), layout
    # a one-rank communicator: the accessors read our own offsets
    uid = ctypes.create_string_buffer(128)
    assert nccl.ncclGetUniqueId(uid) == 0
    comm = ctypes.c_void_p()

    class Uid(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_char * 128)]

    nccl.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, Uid, ctypes.c_int]
    assert nccl.ncclCommInitRank(ctypes.byref(comm), 1, Uid.from_buffer_copy(uid.raw), 0) == 0
    n, r = ctypes.c_int(), ctypes.c_int()
    nccl.ncclCommCount.argtypes = nccl.ncclCommUserRank.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int),
    ]
    assert nccl.ncclCommCount(comm, ctypes.byref(n)) == 0 and n.value == 1
    assert nccl.ncclCommUserRank(comm, ctypes.byref(r)) == 0 and r.value == 0
    assert comm.value is not None
    assert ctypes.c_int.from_address(comm.value + COMM_NRANKS_OFF).value == 1
    assert ctypes.c_int.from_address(comm.value + COMM_RANK_OFF).value == 0
    nccl.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    assert nccl.ncclCommDestroy(comm) == 0
    name = uid.raw[16:80].split(b"\0")[0].decode()
    assert not Path("/dev/shm", name.lstrip("/")).exists()  # the last member out removed it


def test_fault_specs_are_validated() -> None:
    f = parse_fault("slow_link:ranks=2-3,factor=4,from_step=5", world=8, steps=10, layout="pp-dp")
    assert (f.kind, f.ranks, f.factor, f.onset_step) == ("slow_link", (2, 3), 4.0, 5)
    for bad, why in (
        ("straggle:rank=1,factor=2", "unknown kind"),
        ("straggler:rank=1", "missing factor"),
        ("straggler:rank=1,factor=0", "factor must be > 0"),
        ("straggler:rank=9,factor=2", "rank out of range"),
        ("hang:rank=1,step=20", "past the last step"),
        ("hang:rank=1,step=2,seconds=3", "unknown key"),
        ("slow_link:ranks=3,factor=2", "A-B"),
        ("bubble:rank=1,factor=2", "needs layout pp-dp"),
    ):
        with pytest.raises(SpecError, match=why):
            parse_fault(bad, world=8, steps=10, layout="dp")
    with pytest.raises(SpecError, match="unknown kind"):
        StandinJob(StandinConfig(ranks=2, injects=["oops"]))


def test_dp_job_completes_with_truth(tmp_path: Path) -> None:
    job = StandinJob(StandinConfig(ranks=4, steps=10, run_dir=str(tmp_path))).start()
    truth = job.wait(timeout=60)
    assert truth["job"].startswith("standin-") and truth["done"] == [0, 1, 2, 3]
    assert set(truth["returncodes"].values()) == {0}
    for r in range(4):
        steps = truth["step_times"][r]
        assert [s for s, _, _ in steps] == list(range(10))
        assert all(t0 < t1 for _, t0, t1 in steps)
        assert truth["comms"][r] == [{"name": "dp", "nranks": 4, "rank": r, "members": [0, 1, 2, 3]}]
        assert 50 < _median(step_durations_ms(truth, r, (1, 10))) < 400
    assert not job.shm_names() or not any(Path("/dev/shm", n.lstrip("/")).exists() for n in job.shm_names())


def test_blocking_allreduce_makes_peers_wait_for_a_straggler(tmp_path: Path) -> None:
    truth = (
        StandinJob(
            StandinConfig(
                ranks=4, steps=12, injects=["straggler:rank=1,factor=2,from_step=6"], run_dir=str(tmp_path)
            )
        )
        .start()
        .wait(timeout=60)
    )
    before = {r: _median(step_durations_ms(truth, r, (1, 6))) for r in range(4)}
    after = {r: _median(step_durations_ms(truth, r, (7, 12))) for r in range(4)}
    for r in (0, 2, 3):
        assert after[r] > 1.4 * before[r], (before, after)
        assert abs(after[r] - after[1]) < 0.15 * after[1], (before, after)


def _stack_symbols(pid: int, lib: Path) -> Optional[Set[str]]:
    """Exported functions of `lib` with a return address on pid's main-thread stack (None if the
    stack is unreadable)."""
    fields = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
    if len(fields) < 9:
        return None
    base = None
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if parts[-1] == str(lib) and int(parts[2], 16) == 0:
            base = int(parts[0].split("-")[0], 16)
    if base is None:
        return None
    sp, data = int(fields[7], 16), b""
    try:
        with open(f"/proc/{pid}/mem", "rb") as mem:
            for off in range(0, 8192, 512):  # stop at the top of the stack
                mem.seek(sp + off)
                data += mem.read(512)
    except OSError:
        if not data:
            return None
    syms = Elf(lib).symbols
    found = set()
    for (q,) in struct.iter_unpack("<Q", data[: len(data) // 8 * 8]):
        for name, s in syms.items():
            if base + s.vaddr <= q < base + s.vaddr + s.size:
                found.add(name)
    return found


def _blocked_in(pid: int) -> Optional[int]:
    fields = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
    return int(fields[0]) if fields and fields[0].isdigit() else None


def _wait_for_hang(job: StandinJob, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while job.truth()["faults"][0]["hang"] is None:
        job.poll()
        assert time.monotonic() < deadline, "no hang line"
        time.sleep(0.05)
    time.sleep(0.6)  # the peers reach the all-reduce


def test_hang_blocks_live_peers_inside_allreduce(tmp_path: Path) -> None:
    job = StandinJob(
        StandinConfig(
            ranks=4, steps=10, injects=["hang:rank=2,step=3"], hang_hold_s=3.0, run_dir=str(tmp_path)
        )
    ).start()
    try:
        _wait_for_hang(job)
        assert job.libdir is not None
        lib = job.libdir / "libnccl.so.2"
        for r in (0, 1, 3):
            pid = job.pids[r]
            # the main thread sleeps on the rendezvous futex (retry: it wakes to check its peers)
            for _ in range(20):
                if _blocked_in(pid) == SYS_FUTEX:
                    break
                time.sleep(0.05)
            assert _blocked_in(pid) == SYS_FUTEX
            frames = _stack_symbols(pid, lib)
            if frames is not None:
                assert "ncclAllReduce" in frames, frames
        assert job.steps_done() == 3
        truth = job.wait(timeout=30)  # held hang_hold_s, then killed: never done
        assert truth["done"] == [] and job.steps_done() == 3
        hang = truth["faults"][0]
        assert hang["kind"] == "hang" and hang["ranks"] == [2] and hang["hang"]["step"] == 3
        assert hang["hang"]["t_ns"] > 0
    finally:
        job.stop()


def test_pp_dp_job_completes(tmp_path: Path) -> None:
    truth = (
        StandinJob(StandinConfig(ranks=8, steps=6, layout="pp-dp", run_dir=str(tmp_path)))
        .start()
        .wait(timeout=60)
    )
    assert truth["done"] == list(range(8))
    comms: Dict[str, List[int]] = {}
    for r in range(8):
        assert len(truth["step_times"][r]) == 6
        for c in truth["comms"][r]:
            comms[c["name"]] = c["members"]
    assert comms == {
        "pp0": [0, 1],
        "pp1": [2, 3],
        "pp2": [4, 5],
        "pp3": [6, 7],
        "dp-stage0": [0, 2, 4, 6],
        "dp-stage1": [1, 3, 5, 7],
    }


def test_killed_peer_makes_blocked_peers_fail_instead_of_hanging(tmp_path: Path) -> None:
    # rank 2 hangs (alive) so that the others are blocked in ncclAllReduce; then rank 1 is killed
    job = StandinJob(
        StandinConfig(
            ranks=4, steps=10, injects=["hang:rank=2,step=2"], hang_hold_s=60, run_dir=str(tmp_path)
        )
    ).start()
    try:
        _wait_for_hang(job)
        os.kill(job.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:
            job.poll(check=False)
            errors = job.truth()["errors"]
            if {0, 3} <= set(errors):
                break
            time.sleep(0.05)
        errors = job.truth()["errors"]
        assert {0, 3} <= set(errors), job.log_tail(0)
        for r in (0, 3):
            assert errors[r]["call"] == "ncclAllReduce" and errors[r]["code"] == 6  # ncclRemoteError
        assert "peer rank 1" in job.log_tail(0)
    finally:
        job.stop()
