"""Facts about this machine that decide whether BPF probing can work.

`gather_facts()` reads ``/proc``, sysfs and tracefs, makes one ``bpf()`` syscall, imports bcc (and,
when privileged, compiles a trivial program), PINGs Redis and initialises NVML, and returns a plain
`Facts` record. It never raises: a probe that breaks is recorded as an error string. The parsing
helpers are pure. `argus doctor` turns `Facts` into its table; the agent's preflight can reuse the
same probes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit, urlunsplit

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
TRACEFS_PATHS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
# bpf(2) syscall numbers; the generic table (arm64, riscv64, loongarch64) uses 280.
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "loongarch64": 280, "ppc64le": 361, "s390x": 351}


@dataclass(frozen=True)
class Facts:
    """Raw observations about the machine; every field is plain data (see `gather_facts`)."""

    euid: int = 0
    cap_eff: int = 0
    bpf_errno: Optional[int] = 0  # errno of a BPF_MAP_CREATE; 0 = worked; None = not tried
    unprivileged_bpf_disabled: Optional[str] = None
    lockdown: Optional[str] = None  # e.g. "[none] integrity confidentiality"; None = no securityfs
    mounts: Tuple[Tuple[str, str], ...] = ()  # (mount point, fs type)
    uprobe_events: bool = False  # tracefs uprobe_events file visible
    uprobe_pmu: bool = False  # /sys/bus/event_source/devices/uprobe (perf-event uprobes)
    kprobes: bool = False
    btf: bool = False
    kernel_release: str = ""
    headers_build: Optional[str] = None  # resolved /lib/modules/$(uname -r)/build, None if missing
    kheaders: bool = False  # /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS)
    bcc_version: Optional[str] = None
    bcc_error: Optional[str] = None
    bcc_compile_error: Optional[str] = None  # "" = compiled and loaded; None = not tried
    python_version: Tuple[int, int, int] = (3, 11, 0)
    python_executable: str = ""
    target_pythons: Tuple[Tuple[str, str], ...] = ()  # (where, version)
    redis_url: str = DEFAULT_REDIS_URL
    redis_error: Optional[str] = None
    nvml_summary: Optional[str] = None
    nvml_error: Optional[str] = None
    objdump: Optional[str] = None  # its path: decodes NCCL's accessors (argus/probes/nccl_layout.py)
    probe_errors: Tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------- pure helpers


def parse_cap_eff(proc_status: str) -> int:
    """The effective capability mask from the text of ``/proc/<pid>/status`` (0 if absent)."""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", proc_status, re.MULTILINE)
    return int(m.group(1), 16) if m else 0


def parse_mounts(text: str) -> Tuple[Tuple[str, str], ...]:
    """(mount point, fs type) pairs from ``/proc/self/mounts`` text."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            rows.append((parts[1].replace("\\040", " "), parts[2]))
    return tuple(rows)


def mounted_at(mounts: Tuple[Tuple[str, str], ...], fstype: str) -> List[str]:
    return [point for point, kind in mounts if kind == fstype]


def redact_url(url: str) -> str:
    """`url` without its password (never print secrets)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def version_tuple(text: str) -> Optional[Tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def has_cap(cap_eff: int, cap: int) -> bool:
    return bool(cap_eff >> cap & 1)


def can_use_bpf(cap_eff: int) -> bool:
    """CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN (which implies both, and is all pre-5.8 kernels know)."""
    admin = has_cap(cap_eff, CAP_SYS_ADMIN)
    return (has_cap(cap_eff, CAP_BPF) or admin) and (has_cap(cap_eff, CAP_PERFMON) or admin)


# --------------------------------------------------------------------------- gathering (impure)


def bpf_map_create_errno() -> Optional[int]:
    """Try ``bpf(BPF_MAP_CREATE)`` for a one-slot array: 0 if it worked, else errno; None if unknown arch."""
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 30)()  # union bpf_attr prefix, zero-filled
    attr[0], attr[1], attr[2], attr[3] = 2, 4, 4, 1  # BPF_MAP_TYPE_ARRAY, key 4, value 4, 1 entry
    fd = libc.syscall(
        ctypes.c_long(nr), ctypes.c_int(0), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr))
    )
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text()
    except OSError:
        return None


@contextlib.contextmanager
def stderr_to_file() -> Iterator[IO[str]]:
    """Send fd 2 (where bcc's clang prints) to a temp file for the duration: the compiler's
    diagnostics, kept for an error message."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield tmp
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def try_bcc_compile() -> str:
    """Compile and load a trivial program with bcc; "" on success, else a one-line reason."""
    import bcc  # type: ignore[import-not-found]

    with stderr_to_file() as err:
        try:
            b = bcc.BPF(text=b"int argus_doctor(void *ctx) { return 0; }")
            try:
                b.load_func(b"argus_doctor", bcc.BPF.KPROBE)
            finally:
                b.cleanup()
        except Exception as e:
            err.seek(0)
            lines = [ln.strip() for ln in err.read().splitlines() if ln.strip()]
            return (lines[0] + " — " if lines else "") + str(e).splitlines()[0]
    return ""


def find_pythons() -> Tuple[Tuple[str, str], ...]:
    """System (``/usr/bin/python3.X``) and pyenv interpreters that could be targets."""
    found: List[Tuple[str, str]] = []
    for p in sorted(Path("/usr/bin").glob("python3.*")):
        m = re.fullmatch(r"python(\d+\.\d+)", p.name)
        if m:
            found.append(("system", m.group(1)))
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    with contextlib.suppress(OSError):
        names = sorted((d.name for d in root.iterdir()), key=lambda n: version_tuple(n) or (0, 0))
        found += [("pyenv", n) for n in names if re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", n)]
    return tuple(found)


def ping_redis(url: str) -> Optional[str]:
    try:
        from argus import redisconf

        # as every other command connects: credentials from ARGUS_REDIS_* (an ACL user), TLS options
        client = redisconf.parse(url).client(timeout_s=1.0)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def probe_nvml() -> Tuple[Optional[str], Optional[str]]:
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py not installed"
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        return None, str(e)
    if isinstance(driver, bytes):
        driver = driver.decode()
    return f"{count} GPU(s), driver {driver}", None


def gather_facts(redis_url: str = DEFAULT_REDIS_URL) -> Facts:
    """Observe this machine. Never raises: a broken probe becomes a `probe_errors` entry."""
    errors: List[str] = []
    krel = platform.release()
    mounts = parse_mounts(_read("/proc/self/mounts") or "")
    tracefs = next((p for p in reversed(TRACEFS_PATHS) if os.path.exists(p + "/events")), TRACEFS_PATHS[0])
    build = Path(f"/lib/modules/{krel}/build")
    euid = os.geteuid()
    cap_eff = parse_cap_eff(_read("/proc/self/status") or "")

    bpf_errno: Optional[int] = None
    try:
        bpf_errno = bpf_map_create_errno()
    except Exception as e:
        errors.append(f"bpf() probe: {e}")

    bcc_version, bcc_error = None, None
    try:
        import bcc  # type: ignore[import-not-found]

        bcc_version = getattr(bcc, "__version__", None)
        if not hasattr(bcc, "BPF"):
            bcc_error = f"{bcc.__file__} is not iovisor bcc (the unrelated PyPI package?)"
    except Exception as e:
        bcc_error = f"{type(e).__name__}: {e}"

    headers = str(build.resolve()) if build.exists() else None
    privileged = can_use_bpf(cap_eff) and bpf_errno == 0
    compile_error: Optional[str] = None
    if privileged and bcc_error is None and headers is not None:
        try:
            compile_error = try_bcc_compile()
        except Exception as e:
            compile_error = f"{type(e).__name__}: {e}"

    lockdown = _read("/sys/kernel/security/lockdown")
    unpriv = _read("/proc/sys/kernel/unprivileged_bpf_disabled")
    nvml_summary, nvml_error = probe_nvml()
    return Facts(
        euid=euid,
        cap_eff=cap_eff,
        bpf_errno=bpf_errno,
        unprivileged_bpf_disabled=unpriv.strip() if unpriv else None,
        lockdown=lockdown.strip() if lockdown else None,
        mounts=mounts,
        uprobe_events=os.path.exists(tracefs + "/uprobe_events"),
        uprobe_pmu=os.path.exists("/sys/bus/event_source/devices/uprobe/type"),
        kprobes=os.path.exists("/sys/bus/event_source/devices/kprobe/type")
        or os.path.exists(tracefs + "/kprobe_events"),
        btf=os.path.exists("/sys/kernel/btf/vmlinux"),
        kernel_release=krel,
        headers_build=headers,
        kheaders=os.path.exists("/sys/kernel/kheaders.tar.xz"),
        bcc_version=bcc_version,
        bcc_error=bcc_error,
        bcc_compile_error=compile_error,
        python_version=tuple(sys.version_info[:3]),  # type: ignore[arg-type]
        python_executable=sys.executable,
        target_pythons=find_pythons(),
        redis_url=redis_url,
        redis_error=ping_redis(redis_url),
        nvml_summary=nvml_summary,
        nvml_error=nvml_error,
        objdump=shutil.which("objdump"),
        probe_errors=tuple(errors),
    )
