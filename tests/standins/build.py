"""Build the stand-in libcuda.so.1 / libnccl.so.2 into a cache directory keyed by their inputs.

The key hashes the C sources, the flags and the compiler (path and `--version`), so editing a
source or switching compilers rebuilds, and every other build reuses the cached pair. A file lock
makes parallel builds (pytest-xdist workers, several jobs) safe: one compiles, the others wait
and reuse its output. Usage: python -m tests.standins.build [--variant async] [--force]  (prints
the directory).

Two variants, built from their own sources into their own directories: "blocking" (cuda.c,
nccl.c: blocking collectives, no events; <cache>/<key>) and "async" (cuda_async.c, nccl_async.c:
collectives enqueued on streams, CUDA events, a network proxy calling ncclIbIsend;
<cache>/async-<key>). Both are built with the same flags, and both include the shared headers
csrc/*.h (common.h, cuda_common*.h, nccl_common*.h: what the variants have in common), which every
key hashes too.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

CSRC = Path(__file__).resolve().parent / "csrc"
# output name -> source: the names the tracer matches in /proc/PID/maps, and their sonames
LIBS: Dict[str, str] = {"libcuda.so.1": "cuda.c", "libnccl.so.2": "nccl.c"}
VARIANT_LIBS: Dict[str, Dict[str, str]] = {
    "blocking": LIBS,
    "async": {"libcuda.so.1": "cuda_async.c", "libnccl.so.2": "nccl_async.c"},
}
VARIANTS = tuple(VARIANT_LIBS)
# Stripped (-s: no .symtab, as vendors ship), frame pointers omitted, only the API exported.
CFLAGS: List[str] = [
    "-O2",
    "-fomit-frame-pointer",
    "-fPIC",
    "-shared",
    "-s",
    "-pthread",
    "-fvisibility=hidden",
    "-Wall",
    "-Wl,--build-id",
]
LDLIBS: Dict[str, List[str]] = {"libcuda.so.1": [], "libnccl.so.2": ["-ldl", "-lrt"]}
STAMP = ".complete"


class BuildError(RuntimeError):
    pass


def compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    path = shutil.which(cc)
    if path is None:
        raise BuildError(f"no C compiler: {cc!r} is not on PATH (install gcc, or set CC)")
    return path


def cache_root() -> Path:
    env = os.environ.get("ARGUS_STANDIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "argus" / "standins"


def _libs(variant: str) -> Dict[str, str]:
    if variant not in VARIANT_LIBS:
        raise ValueError(f"unknown stand-in variant {variant!r} (expected one of {', '.join(VARIANTS)})")
    return VARIANT_LIBS[variant]


def headers() -> List[Path]:
    """The headers the sources include (csrc/*.h, shared by both variants)."""
    return sorted(CSRC.glob("*.h"))


def build_key(cc: Optional[str] = None, variant: str = "blocking") -> str:
    """The cache directory's name: a hash of the sources and headers, flags and compiler (for
    "async", prefixed "async-" and the variant hashed in)."""
    libs = _libs(variant)
    cc = cc or compiler()
    h = hashlib.sha256()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    for part in (os.path.realpath(cc), version, " ".join(CFLAGS), repr(sorted(LDLIBS.items()))):
        h.update(part.encode() + b"\0")
    if variant != "blocking":  # the blocking family keeps the key it always had
        h.update(f"variant={variant}".encode() + b"\0")
    for name, src in sorted(libs.items()):
        h.update(name.encode() + b"\0" + (CSRC / src).read_bytes() + b"\0")
    for hdr in headers():
        h.update(hdr.name.encode() + b"\0" + hdr.read_bytes() + b"\0")
    key = h.hexdigest()[:16]
    return key if variant == "blocking" else f"{variant}-{key}"


def _compile(cc: str, out_dir: Path, libs: Dict[str, str]) -> None:
    for name, src in libs.items():
        cmd = [cc, *CFLAGS, f"-Wl,-soname,{name}", "-o", str(out_dir / name), str(CSRC / src), *LDLIBS[name]]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
        if r.stderr.strip():  # warnings are bugs in code this small: show them
            print(r.stderr, file=sys.stderr)


def build(force: bool = False, variant: str = "blocking") -> Path:
    """The directory holding libcuda.so.1 and libnccl.so.2 of `variant` for the current sources."""
    libs = _libs(variant)
    cc = compiler()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = build_key(cc, variant)
    final = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / STAMP).exists() and not force:
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root))
        try:
            _compile(cc, tmp, libs)
            (tmp / STAMP).write_text(f"{cc}\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)  # whole directory at once: readers never see half a build
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="build the stand-in libraries; prints their directory")
    p.add_argument("--variant", choices=VARIANTS, default="blocking")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache has them")
    a = p.parse_args()
    print(build(force=a.force, variant=a.variant))
