"""Build the simulated libcuda.so.1 / libnccl.so.2 with the system compiler, once per source change.

The libraries land in a cache directory keyed by a hash of the sources and flags, so a changed
source rebuilds and concurrent builders never see a half-written library (build in a temporary
directory, then rename).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from argus.errors import EnvironmentProblem

CSRC = Path(__file__).resolve().parent / "csrc"
COMMON = [
    "-O2",
    "-g",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fno-omit-frame-pointer",
    "-mno-omit-leaf-frame-pointer",
    "-fno-shrink-wrap",
    "-fno-optimize-sibling-calls",
    "-fvisibility=hidden",
    "-Wall",
]
# libcuda entry points begin with `push` like NVIDIA's; libnccl's begin with `endbr64` (a CET
# build), so the agent's first-instruction logic (attach past endbr64) is exercised.
# libcuda is linked at a non-zero base, so its symbols' virtual addresses differ from their file
# offsets (as with lld-linked libraries): attach code must not confuse the two.
CUDA_FLAGS = [*COMMON, "-fcf-protection=none", "-Wl,-soname,libcuda.so.1", "-Wl,-Ttext-segment=0x100000"]
NCCL_FLAGS = [
    *COMMON,
    "-fcf-protection=branch",
    "-fno-schedule-insns2",
    "-Wl,-soname,libnccl.so.2",
    "-Wl,-rpath,$ORIGIN",
]


@dataclass(frozen=True)
class SimLibs:
    directory: Path
    libcuda: Path
    libnccl: Path


def cache_root() -> Path:
    env = os.environ.get("ARGUS_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "argus" if xdg else Path.home() / ".cache" / "argus"


def _fingerprint(cc: str) -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*.[ch]")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(repr((CUDA_FLAGS, NCCL_FLAGS, cc)).encode())
    return h.hexdigest()[:16]


def _compile(cc: str, out: Path, sources: list[str], flags: list[str], extra: list[str]) -> None:
    cmd = [cc, *flags, "-o", str(out), *[str(CSRC / s) for s in sources], *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise EnvironmentProblem(
            f"building the simulated {out.name} failed: {res.stderr.strip().splitlines()[-1:]}",
            "install a C compiler (sudo scripts/setup.sh installs gcc) and retry",
        )


def build(force: bool = False) -> SimLibs:
    """Return the simulated libraries, compiling them first when the sources changed."""
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise EnvironmentProblem(
            f"C compiler '{cc}' not found: the simulated GPU libraries are built at first use",
            "sudo scripts/setup.sh (installs gcc), or set CC",
        )
    final = cache_root() / f"sim-{_fingerprint(cc)}"
    libs = SimLibs(final, final / "libcuda.so.1", final / "libnccl.so.2")
    if not force and libs.libcuda.exists() and libs.libnccl.exists():
        return libs
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sim-build-", dir=final.parent))
    try:
        _compile(cc, tmp / "libcuda.so.1", ["cuda.c"], CUDA_FLAGS, [])
        _compile(cc, tmp / "libnccl.so.2", ["nccl.c"], NCCL_FLAGS, [f"-L{tmp}", "-l:libcuda.so.1", "-lrt"])
        for p in tmp.iterdir():
            p.chmod(0o755)
        tmp.chmod(0o755)
        if force and final.exists():
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race: use its build
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return libs
