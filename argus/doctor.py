"""`argus doctor`: can probing work on this machine, and if not, what to do about it.

Two halves, kept apart so the logic is testable without root:

* `argus.hostfacts.gather_facts()` reads the machine (``/proc``, sysfs, tracefs, one ``bpf()``
  syscall, ``import bcc``, a Redis PING, NVML) into a plain `Facts` record and never raises.
* `evaluate(facts)` here is pure: it turns `Facts` into a list of `Check` rows (OK/INFO/WARN/FAIL, each
  non-OK with a fix). `render_table` / `render_json` print them.

Probing needs every row to be non-FAIL; Redis and NVML are WARN at worst (probing works without
them). Feature checks probe the running kernel instead of comparing kernel versions.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Dict, List, Optional, Tuple

import click

from argus.errors import ArgusError, PreconditionsFailed
from argus.hostfacts import (
    CAP_BPF,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    DEFAULT_REDIS_URL,
    TRACEFS_PATHS,
    Facts,
    can_use_bpf,
    gather_facts,
    has_cap,
    mounted_at,
    redact_url,
    version_tuple,
)

SUPPORTED_TARGET_PYTHON = ((3, 9), (3, 13))
SETUP_CMD = "sudo scripts/setup.sh"
# Issues that scripts/setup.sh fixes.
_SETUP_FIXES = {"tracefs", "debugfs", "kernel headers", "bcc", "bcc compile"}


class Status(str, Enum):
    OK = "OK"
    INFO = "INFO"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    """One row of the doctor table. `fix` is empty for OK/INFO rows."""

    name: str
    status: Status
    detail: str
    fix: str = ""


# --------------------------------------------------------------------------- checks (pure)


def check_privileges(euid: int, cap_eff: int) -> Check:
    named = (("CAP_BPF", CAP_BPF), ("CAP_PERFMON", CAP_PERFMON), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))
    held = [name for name, cap in named if has_cap(cap_eff, cap)]
    who = "root (euid 0)" if euid == 0 else f"euid {euid}"
    caps = ", ".join(held) if held else "none of CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN"
    detail = f"{who}; CapEff {cap_eff:#x}: {caps}"
    if can_use_bpf(cap_eff):
        return Check("privileges", Status.OK, detail)
    if euid == 0:
        fix = (
            "root without BPF capabilities (an unprivileged container?): run it with --privileged, "
            "or --cap-add SYS_ADMIN --cap-add BPF --cap-add PERFMON, and --pid=host"
        )
    else:
        fix = "run as root: sudo argus doctor (or grant CAP_BPF+CAP_PERFMON: setcap / container --cap-add)"
    return Check("privileges", Status.FAIL, detail, fix)


def check_bpf_syscall(bpf_errno: Optional[int], unprivileged_disabled: Optional[str], euid: int) -> Check:
    sysctl = f"unprivileged_bpf_disabled={unprivileged_disabled}" if unprivileged_disabled else ""
    if bpf_errno is None:
        return Check("bpf syscall", Status.WARN, f"not tried on {platform.machine()}; {sysctl}".strip("; "))
    if bpf_errno == 0:
        return Check("bpf syscall", Status.OK, f"BPF_MAP_CREATE works; {sysctl}".strip("; "))
    name = errno.errorcode.get(bpf_errno, str(bpf_errno))
    detail = f"BPF_MAP_CREATE failed: {name} ({os.strerror(bpf_errno)}); {sysctl}".strip("; ")
    if bpf_errno == errno.ENOSYS:
        fix = "the kernel lacks CONFIG_BPF_SYSCALL (or seccomp hides bpf()): use a BPF-enabled kernel"
    elif bpf_errno == errno.EPERM and euid != 0:
        fix = "only privileged users may use bpf() here: sudo argus doctor"
    elif bpf_errno == errno.EPERM:
        fix = "bpf() refused to root: a container seccomp profile or LSM blocks it; run --privileged"
    else:
        fix = "the kernel refused a trivial BPF map; check dmesg and the memlock limit (ulimit -l)"
    return Check("bpf syscall", Status.FAIL, detail, fix)


def check_lockdown(lockdown: Optional[str]) -> Check:
    if lockdown is None:
        return Check("lockdown", Status.OK, "no lockdown LSM interface (not locked down)")
    m = re.search(r"\[(\w+)\]", lockdown)
    mode = m.group(1) if m else lockdown.strip()
    if mode == "confidentiality":
        return Check(
            "lockdown",
            Status.WARN,
            "confidentiality: BPF may not read kernel memory (user-memory reads still work)",
            "boot with lockdown=integrity or none if probes report read errors",
        )
    return Check("lockdown", Status.OK, f"lockdown={mode}")


def check_tracefs(mounts: Tuple[Tuple[str, str], ...]) -> Check:
    points = [p for p in mounted_at(mounts, "tracefs") if p in TRACEFS_PATHS]
    if points:
        return Check("tracefs", Status.OK, "mounted at " + ", ".join(points))
    return Check(
        "tracefs",
        Status.FAIL,
        "not mounted at /sys/kernel/tracing or /sys/kernel/debug/tracing",
        f"mount -t tracefs tracefs /sys/kernel/tracing (or {SETUP_CMD})",
    )


def check_debugfs(mounts: Tuple[Tuple[str, str], ...]) -> Check:
    if "/sys/kernel/debug" in mounted_at(mounts, "debugfs"):
        return Check("debugfs", Status.OK, "mounted at /sys/kernel/debug")
    return Check(
        "debugfs",
        Status.WARN,
        "not mounted (bcc falls back to /sys/kernel/tracing)",
        f"mount -t debugfs debugfs /sys/kernel/debug (or {SETUP_CMD})",
    )


def check_uprobes(uprobe_events: bool, uprobe_pmu: bool) -> Check:
    ways = [w for w, ok in (("perf uprobe PMU", uprobe_pmu), ("tracefs uprobe_events", uprobe_events)) if ok]
    if ways:
        return Check("uprobes", Status.OK, " and ".join(ways))
    return Check(
        "uprobes",
        Status.FAIL,
        "no uprobe PMU in /sys/bus/event_source/devices and no uprobe_events in tracefs",
        "use a kernel with CONFIG_UPROBE_EVENTS=y (and mount tracefs)",
    )


def check_kprobes(present: bool) -> Check:
    if present:
        return Check("kprobes", Status.INFO, "present (Argus does not need them)")
    return Check("kprobes", Status.INFO, "absent: fine, Argus uses only uprobes, tracepoints and perf events")


def check_btf(present: bool) -> Check:
    if present:
        return Check("btf", Status.OK, "/sys/kernel/btf/vmlinux")
    return Check(
        "btf",
        Status.WARN,
        "no /sys/kernel/btf/vmlinux (uprobe programs still work)",
        "a kernel with CONFIG_DEBUG_INFO_BTF=y gives better verifier messages",
    )


def check_headers(kernel_release: str, build: Optional[str], kheaders: bool) -> Check:
    link = f"/lib/modules/{kernel_release}/build"
    if build is not None:
        detail = f"{link} -> {build}"
        if kernel_release and kernel_release not in build:
            detail += " (headers of another kernel: fine for uprobe programs, which read no kernel structs)"
        return Check("kernel headers", Status.OK, detail)
    if kheaders:
        return Check("kernel headers", Status.OK, "/sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS)")
    return Check(
        "kernel headers",
        Status.FAIL,
        f"{link} missing (bcc compiles against it)",
        f"apt-get install linux-headers-$(uname -r), or {SETUP_CMD} (links Debian's linux-headers-amd64)",
    )


def check_bcc(version: Optional[str], error: Optional[str], executable: str) -> Check:
    if error is None:
        return Check("bcc", Status.OK, f"import bcc {version or '?'} in {executable}")
    return Check(
        "bcc",
        Status.FAIL,
        f"import bcc failed in {executable}: {error}",
        "run argus from the venv made by /usr/bin/python3 -m venv --system-site-packages .venv "
        f"({SETUP_CMD}); bcc is Debian's python3-bpfcc, never PyPI's unrelated `bcc`",
    )


def check_bcc_compile(error: Optional[str]) -> Check:
    if error is None:
        return Check("bcc compile", Status.INFO, "skipped (needs privileges, bcc and kernel headers)")
    if error == "":
        return Check("bcc compile", Status.OK, "compiled and loaded a trivial BPF program")
    return Check(
        "bcc compile",
        Status.FAIL,
        f"a trivial BPF program failed: {error}",
        f"check the kernel headers link ({SETUP_CMD}) and run with -v for bcc's messages",
    )


def check_agent_python(version: Tuple[int, int, int], executable: str) -> Check:
    text = ".".join(map(str, version))
    if version[:2] >= (3, 9):
        return Check("agent python", Status.OK, f"{text} ({executable})")
    return Check("agent python", Status.FAIL, f"{text} ({executable})", "Argus needs Python >= 3.9")


def check_target_pythons(found: Tuple[Tuple[str, str], ...]) -> Check:
    lo, hi = SUPPORTED_TARGET_PYTHON
    rng = f"{lo[0]}.{lo[1]}–{hi[0]}.{hi[1]}"
    inside = [f"{where} {v}" for where, v in found if lo <= (version_tuple(v) or (0, 0)) <= hi]
    outside = [f"{where} {v}" for where, v in found if not lo <= (version_tuple(v) or (0, 0)) <= hi]
    detail = f"supported targets CPython {rng}; found: " + (", ".join(inside) or "none")
    if outside:
        detail += "; unsupported: " + ", ".join(outside)
    return Check("target pythons", Status.OK if inside else Status.INFO, detail)


def check_redis(url: str, error: Optional[str]) -> Check:
    shown = redact_url(url)
    if error is None:
        return Check("redis", Status.OK, f"PING {shown}")
    return Check(
        "redis",
        Status.WARN,
        f"{shown} unreachable: {error} (probing works without it)",
        "start one: redis-server --port 6379 --save '' &  (or pass --redis URL)",
    )


def check_nvml(summary: Optional[str], error: Optional[str]) -> Check:
    if error is None:
        return Check("nvml", Status.OK, summary or "NVML initialised")
    return Check(
        "nvml",
        Status.WARN,
        f"no NVIDIA driver; GPU metrics channel off ({error})",
        "install the NVIDIA driver on GPU hosts; CUDA/NCCL/Python probing works without it",
    )


def check_objdump(path: Optional[str]) -> Check:
    if path:
        return Check(
            "objdump", Status.OK, f"{path} (decodes libnccl's accessors: communicators created before attach)"
        )
    return Check(
        "objdump",
        Status.WARN,
        "not found: communicators created before attach are identified by the layout table only",
        "apt-get install binutils",
    )


def check_install(where: str, problem: Optional[str], unavailable: Dict[str, str]) -> Check:
    """The argus package itself: where it is imported from, whether its BPF and simulator sources
    are there and trusted (`problem`), and which commands could not be imported (argus/cli.py)."""
    if problem is not None:
        return Check(
            "argus install",
            Status.FAIL,
            f"{where}: {problem}",
            "reinstall argus-tracer (pip install . from a checkout, or the wheel); the BPF sources "
            "are package data (argus/bpf)",
        )
    if unavailable:
        broken = "; ".join(f"{name}: {why}" for name, why in sorted(unavailable.items()))
        return Check(
            "argus install",
            Status.FAIL,
            f"{where}: commands unavailable: {broken}",
            f"{sys.executable} -m pip check names missing dependencies; reinstall argus-tracer",
        )
    return Check(
        "argus install",
        Status.OK,
        f"{where} (BPF and simulator sources present, writable by no one but root and their owner)",
    )


def check_config(path: Optional[str]) -> Check:
    """Which TOML config file the commands read (argus/conffile.py); a broken one never gets here:
    it stops every command, doctor included, with its own ERROR."""
    from argus import conffile

    if path is None:
        return Check(
            "config",
            Status.INFO,
            f"none: built-in defaults ({conffile.DEFAULT_PATH} absent, ${conffile.ENV_CONFIG} unset)",
        )
    return Check("config", Status.OK, f"{path} (read and checked; flags and ARGUS_<COMMAND>_<OPTION> win)")


def gather_install() -> Tuple[str, Optional[str], Dict[str, str]]:
    """Where this argus is imported from, why the agent would not load its BPF sources or the
    simulator could not build (None: both fine), and the commands whose import failed."""
    import argus
    from argus.cli import UNAVAILABLE

    where = os.path.dirname(os.path.realpath(argus.__file__))
    problem: Optional[str] = None
    try:
        from argus.agent import bpfprog, privs
        from argus.probes import cpython, host, libcuda, libcudart, libnccl
        from argus.sim.build import CSRC

        bpfprog.full_text([m.CHANNEL for m in (libcuda, libcudart, libnccl, cpython, host)])  # reads each
        files = sorted(p.name for p in bpfprog.BPF_DIR.iterdir() if p.is_file())
        privs.check_trusted(bpfprog.BPF_DIR, files)  # what `argus probe` does before loading them
        missing = [n for n in ("cuda.c", "nccl.c") if not (CSRC / n).is_file()]
        if missing:
            problem = f"simulator sources missing from {CSRC}: {', '.join(missing)}"
    except ArgusError as e:
        problem = e.message
    except Exception as e:  # a missing file, a broken module: say what
        problem = f"{type(e).__name__}: {e}"
    return where, problem, dict(UNAVAILABLE)


def evaluate(f: Facts) -> List[Check]:
    """All checks, in display order. Pure: depends only on `f`."""
    checks = [
        check_privileges(f.euid, f.cap_eff),
        check_bpf_syscall(f.bpf_errno, f.unprivileged_bpf_disabled, f.euid),
        check_lockdown(f.lockdown),
        check_tracefs(f.mounts),
        check_debugfs(f.mounts),
        check_uprobes(f.uprobe_events, f.uprobe_pmu),
        check_kprobes(f.kprobes),
        check_btf(f.btf),
        check_headers(f.kernel_release, f.headers_build, f.kheaders),
        check_bcc(f.bcc_version, f.bcc_error, f.python_executable),
        check_bcc_compile(f.bcc_compile_error),
        check_agent_python(f.python_version, f.python_executable),
        check_target_pythons(f.target_pythons),
        check_redis(f.redis_url, f.redis_error),
        check_nvml(f.nvml_summary, f.nvml_error),
        check_objdump(f.objdump),
    ]
    checks += [Check("doctor", Status.WARN, e, "please report this") for e in f.probe_errors]
    return checks


def failure(checks: List[Check], euid: int) -> Optional[PreconditionsFailed]:
    """The error to raise when any check FAILed, with a hint naming the first thing to do."""
    failed = [c.name for c in checks if c.status is Status.FAIL]
    if not failed:
        return None
    hints = []
    if euid != 0 and {"privileges", "bpf syscall"} & set(failed):
        hints.append("run as root: sudo argus doctor")
    if _SETUP_FIXES & set(failed):
        hints.append(f"prepare the machine: {SETUP_CMD}")
    hints.append("see the fix column above")
    noun = "check" if len(failed) == 1 else "checks"
    return PreconditionsFailed(f"{len(failed)} {noun} failed: {', '.join(failed)}", "; ".join(hints))


# --------------------------------------------------------------------------- rendering


_STYLE = {Status.OK: "green", Status.INFO: "cyan", Status.WARN: "yellow", Status.FAIL: "bold red"}


def render_table(checks: List[Check], width: Optional[int] = None) -> str:
    """The doctor table as text (ANSI colours only when printing to a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(expand=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for c in checks:
        table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status.value}[/]", c.detail, c.fix)
    tty = sys.stdout.isatty()
    console = Console(width=width or (None if tty else 140), force_terminal=tty, highlight=False)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def render_json(checks: List[Check]) -> str:
    rows = [{**asdict(c), "status": c.status.value} for c in checks]
    ok = not any(c.status is Status.FAIL for c in checks)
    return json.dumps({"ok": ok, "checks": rows}, indent=2)


def _validate_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value.split("://", 1)[0].lower() not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        raise click.BadParameter(
            "expected redis://HOST:PORT/DB, rediss://…, unix://PATH or redis+cluster://HOST:PORT,HOST:PORT"
        )
    return value


@click.command("doctor")
@click.option(
    "--redis",
    "redis_url",
    default=DEFAULT_REDIS_URL,
    show_default=True,
    callback=_validate_url,
    help="Redis URL to test (password never printed).",
)
@click.option("-j", "--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor_cmd(redis_url: str, as_json: bool) -> None:
    """Check every precondition for probing and say how to fix what is missing.

    Exits 0 when probing can work here (no FAIL row); Redis and NVML problems are warnings.

    \b
    Examples:
      sudo argus doctor
      sudo argus doctor --redis redis://10.0.0.5:6379/0
      argus doctor --json | jq '.checks[] | select(.status == "FAIL")'
    """
    facts = gather_facts(redis_url)
    checks = evaluate(facts)
    checks.insert(len(checks) - len(facts.probe_errors), check_install(*gather_install()))
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    checks.insert(len(checks) - len(facts.probe_errors), check_config(meta.get("argus.config")))
    if as_json:
        click.echo(render_json(checks))
    else:
        click.echo(render_table(checks), nl=False)
    err = failure(checks, facts.euid)
    if err is not None:
        raise err
    if not as_json:
        warns = sum(c.status is Status.WARN for c in checks)
        click.echo(f"probing can work here ({warns} warning{'s' if warns != 1 else ''})")
