"""Build, check and load the BPF programs of the selected channels with bcc.

One compile unit holds the channel files the user enabled (argus/bpf/cuda.bpf.c, argus/bpf/nccl.bpf.c),
so maps such as the per-process epoch are shared. Knobs are -D macros built by `cflags()`.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Sequence, Set

from argus import hostfacts
from argus.agent import privs
from argus.errors import EnvironmentProblem, PermissionDenied
from argus.probes.base import Channel, call_cflags

BPF_DIR = Path(__file__).resolve().parents[1] / "bpf"  # package data: an installed argus traces
ALWAYS = "steps.bpf.c"  # the step marker (--step-fn), whichever channels are on
OFFCPU = "offcpu.bpf.c"  # sched_switch: off-CPU time for these channels' stacks
OFFCPU_FOR = ("python.bpf.c", "host.bpf.c")
_INCLUDE = re.compile(r'\s*#\s*include\s*"([^"]+)"')
_IF = re.compile(r"\s*#\s*if")  # #if, #ifdef, #ifndef
_ENDIF = re.compile(r"\s*#\s*endif\b")


@dataclass(frozen=True)
class BpfOptions:
    launch_latency: bool = False  # probe launch returns too (a uretprobe per launch)
    # time of launches that waited for a full launch queue (their returns probed: the probe keeps
    # launch probes in windows of steps, so only there; argus/agent/launchwin.py)
    launch_wait: bool = False
    # 8 MiB: the burst of records between two drains at tensor-parallel rates (8 ranks x 3,240
    # collectives per 1.6 s step, plus Python marks) overflowed 1 MiB while the agent summarized
    # and lost every step boundary; 4 MiB was the smallest that lost none (docs/benchmarks.md)
    ringbuf_pages: int = 2048
    max_targets: int = 1024
    python_hz: int = 49  # Python stack sampling (python channel)
    host_hz: int = 19  # native stack sampling (host channel)
    python_launch_every: int = 16  # walk the Python stack at every n-th kernel launch of a thread
    python_coll_every: int = 4  # ... and at every n-th collective
    record: bool = False  # `argus record`: a record per call, sample and off-CPU span
    # collective records per communicator and step at most; past it every n-th, the rest summed in
    # BPF (nccl.bpf.c): at tensor-parallel rates a record per collective was most of the agent's CPU,
    # and each recorded one still brings its completions, waits and a bound (docs/benchmarks.md 8.10:
    # 64 -> 32 took the agent from 1.8% to 1.35% of a core for 8 tp ranks); a straggler is late at
    # every collective, named from 2-4 a step (tests/test_attach_late_e2e.py every-nth).
    # 0: every collective (`argus record` always)
    coll_records: int = 32

    @property
    def launch_returns(self) -> bool:
        """Whether cuLaunchKernel's return is probed (latency histogram, record, launch errors)."""
        return self.launch_latency or self.record or self.launch_wait


def cflags(channels: Sequence[Channel], opts: BpfOptions) -> List[str]:
    flags = [
        f"-I{BPF_DIR}",
        f"-DARGUS_RINGBUF_PAGES={opts.ringbuf_pages}",
        f"-DARGUS_MAX_TARGETS={opts.max_targets}",
    ]
    flags += [f"-D{c.macro}" for c in channels]
    if opts.launch_latency:
        flags.append("-DARGUS_LAUNCH_LATENCY")
    if opts.launch_wait:
        flags.append("-DARGUS_LAUNCH_WAIT")
    names = {c.name for c in channels}
    if "python" in names:
        flags.append(f"-DARGUS_PY_PERIOD_NS={int(1e9 / opts.python_hz)}")
        flags.append(f"-DARGUS_PY_LAUNCH_EVERY={max(1, opts.python_launch_every)}")
        flags.append(f"-DARGUS_PY_COLL_EVERY={max(1, opts.python_coll_every)}")
    if "host" in names:
        flags.append(f"-DARGUS_HOST_PERIOD_NS={int(1e9 / opts.host_hz)}")
    if opts.record:
        flags.append("-DARGUS_RECORD")
    return flags + call_cflags()


def source(channels: Sequence[Channel]) -> str:
    """The compile unit: the enabled channels' files, steps.bpf.c and, with the Python or host
    channel, offcpu.bpf.c, in any order. bcc makes programs only of the main file's functions and
    rewrites map calls (`targets.lookup(...)`) only there (argus.h as a real #include fails to
    load), so the files' `#include "..."` of argus/bpf/ files are pasted in here, each file once,
    with #line so compiler errors name the real file and line."""
    names = [ALWAYS, *(c.source for c in channels)]
    if any(n in OFFCPU_FOR for n in names):
        names.append(OFFCPU)
    out: List[str] = []
    seen: Set[str] = set()
    for name in names:
        _paste(name, out, seen)
    return "\n".join(out)


def _paste(name: str, out: List[str], seen: Set[str]) -> None:
    """Append argus/bpf/<name> with its own argus/bpf includes pasted in at their lines, unless an
    earlier file included it. Pasting once is what the headers' include guards would do, as long as
    no such include sits inside an #if (a header that depends on a channel wraps its content in the
    channel's #ifdef instead): refused, so a skipped first include cannot hide a later one."""
    if name in seen:
        return
    seen.add(name)
    path = BPF_DIR / name
    lines = path.read_text().splitlines()
    directives = [ln.split() for ln in lines if ln.lstrip().startswith("#")][:2]
    guarded = (
        len(directives) == 2
        and directives[0][:1] == ["#ifndef"]
        and directives[1] == ["#define", *directives[0][1:]]
    )
    depth = 0
    out.append(f'#line 1 "{path}"')
    for i, line in enumerate(lines, 1):
        m = _INCLUDE.match(line)
        if m and (BPF_DIR / m.group(1)).is_file():
            if depth != int(guarded):
                raise ValueError(
                    f'{path}:{i}: #include "{m.group(1)}" inside an #if; include it unconditionally'
                )
            _paste(m.group(1), out, seen)
            out.append(f'#line {i + 1} "{path}"')
            continue
        if _IF.match(line):
            depth += 1
        elif _ENDIF.match(line):
            depth -= 1
        out.append(line)


def full_text(channels: Sequence[Channel]) -> str:
    """The whole program as compiled, for `--ebpf` (every header is pasted in)."""
    return source(channels)


def preflight() -> None:
    """Fail early, with a hint, on what would make loading fail."""
    cap = hostfacts.parse_cap_eff(Path("/proc/self/status").read_text())
    if os.geteuid() != 0 and not hostfacts.can_use_bpf(cap):
        raise PermissionDenied(
            "argus probe needs root (or CAP_BPF + CAP_PERFMON) to load BPF programs",
            f"sudo {' '.join(['argus', *sys.argv[1:]])}   (in a container: --privileged --pid=host)",
        )
    try:
        import bcc  # noqa: F401
    except ImportError:
        raise EnvironmentProblem(
            f"the bcc Python module is not importable from {sys.executable}",
            "sudo scripts/setup.sh (installs python3-bpfcc and a venv with --system-site-packages); "
            "the PyPI package named bcc is unrelated",
        ) from None
    build = Path(f"/lib/modules/{platform.release()}/build")
    if not build.exists():
        raise EnvironmentProblem(
            f"no kernel headers at {build}: bcc cannot compile",
            "sudo scripts/setup.sh (links Debian's linux-headers-amd64)",
        )
    if (
        not Path("/sys/kernel/tracing/uprobe_events").exists()
        and not Path("/sys/kernel/debug/tracing/uprobe_events").exists()
    ):
        raise EnvironmentProblem(
            "tracefs is not mounted (uprobes need it)",
            "mount -t tracefs tracefs /sys/kernel/tracing  (or sudo scripts/setup.sh)",
        )


def fix_uprobe_abi() -> None:
    """Debian's bcc 0.26 Python binding declares libbcc's `bpf_attach_uprobe` with 6 arguments, but
    the C function takes a 7th, `ref_ctr_offset`, which then receives whatever is in the register
    (seen: 0x6). A non-zero value makes the kernel treat the probe as a USDT probe with a semaphore
    at that file offset — it would write a counter into every process mapping the library (here:
    into the ELF header) — and refuse other tools' uprobes at the same address ("ref_ctr_offset
    mismatch" in dmesg). Route the call through a 7-argument prototype that passes 0."""
    import ctypes

    from bcc import libbcc

    lib = libbcc.lib
    if getattr(lib, "_argus_uprobe_abi", False):
        return
    real = lib["bpf_attach_uprobe"]  # a new function pointer: bcc's own declaration stays untouched
    real.restype = ctypes.c_int
    real.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulonglong,
        ctypes.c_int,
        ctypes.c_uint32,
    ]

    def attach(progfd: int, kind: int, ev_name: bytes, path: bytes, addr: int, pid: int, ref: int = 0) -> int:
        return int(real(progfd, kind, ev_name, path, addr, pid, ref))

    lib.bpf_attach_uprobe = attach
    lib._argus_uprobe_abi = True


def load(channels: Sequence[Channel], opts: BpfOptions) -> Any:
    from bcc import BPF

    # root runs this code in the kernel: no one else may be able to change it (argus/agent/privs.py)
    privs.check_trusted(BPF_DIR, sorted(p.name for p in BPF_DIR.iterdir() if p.is_file()))
    fix_uprobe_abi()
    with hostfacts.stderr_to_file() as err:  # bcc's compiler writes diagnostics to fd 2
        try:
            bpf = BPF(text=source(channels), cflags=cflags(channels, opts))
            release_compiler_pages()
            return bpf
        except Exception as e:
            err.seek(0)
            diag = [ln for ln in err.read().splitlines() if "error" in ln]
            raise EnvironmentProblem(
                f"compiling the BPF programs failed: {(diag or [str(e)])[0].strip()}",
                "run `argus doctor`; `argus probe --ebpf` prints the program and flags",
            ) from None


MADV_DONTNEED = 4
# the compiler bcc links (LLVM, clang): ~80 MB of code and read-only data paged in by one compile
COMPILER_LIBS = ("libLLVM", "libclang")


def release_compiler_pages(maps: str = "/proc/self/maps") -> int:
    """Drop the compiler's code pages from our RSS once the program is compiled: they are file pages
    the kernel reads back if bcc ever compiles again, and otherwise made up most of the ~80 MB of the
    agent's ~220 MB for its whole run (docs/benchmarks.md 8.7). Returns the bytes advised."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    try:
        lines = open(maps).read().splitlines()
    except OSError:
        return 0
    for line in lines:
        parts = line.split()
        # code only: a read-only data mapping may hold relocated pages (RELRO), which a drop would
        # turn back into the file's unrelocated bytes
        if len(parts) < 6 or parts[1] != "r-xp" or not any(lib in parts[5] for lib in COMPILER_LIBS):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if libc.madvise(lo, hi - lo, MADV_DONTNEED) == 0:
            done += hi - lo
    return done
