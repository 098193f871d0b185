"""Helpers shared by the benchmarks: observer processes, peak RSS, CPU time, machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]


def env() -> Dict[str, str]:
    pypath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=pypath)


def sigint_default() -> None:
    """preexec_fn for a child the benchmark stops with SIGINT: started from a shell's background job
    (`cmd &`, a CI runner) it would inherit SIGINT ignored and never stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def status_kb(pid: int, field: str) -> int:
    """A /proc/PID/status field in kB (VmRSS, VmHWM); 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included); 0 when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float], fmt: str = "{:.4f}") -> str:
    return ", ".join(fmt.format(x) for x in xs)


def pct(a: float, base: float) -> str:
    return f"{100 * (a - base) / base:+.2f}%"


class Observer:
    """A tracer run as a child: stdout to a file, stderr collected, CPU and peak RSS sampled."""

    def __init__(
        self, argv: List[str], stdout_path: Optional[Path] = None, ready: str = "", merge: bool = False
    ) -> None:
        self.argv = argv
        self.out_path = stdout_path
        self._out = subprocess.PIPE if merge else subprocess.DEVNULL
        if stdout_path:
            self._out = open(stdout_path, "wb")
        self.p = subprocess.Popen(
            argv,
            stdout=self._out,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE,
            text=True,
            cwd=str(REPO),
            env=env(),
        )
        self.err: List[str] = []
        self.t_start = time.monotonic()
        self.t_ready: Optional[float] = None
        self.hwm_kb = 0
        self.cpu0 = 0.0
        self.t0 = 0.0
        self.ready_text = ready
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._sample, daemon=True).start()

    def _read(self) -> None:
        stream = self.p.stderr if self.p.stderr is not None else self.p.stdout
        assert stream is not None
        for line in stream:
            self.err.append(line)
            if self.t_ready is None and self.ready_text and self.ready_text in line:
                self.t_ready = time.monotonic()

    def _sample(self) -> None:
        while self.p.poll() is None:
            self.hwm_kb = max(self.hwm_kb, status_kb(self.p.pid, "VmHWM"))
            time.sleep(0.1)

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds from start to the ready line; raises when the observer died first."""
        deadline = time.monotonic() + timeout
        while self.t_ready is None:
            if self.p.poll() is not None or time.monotonic() > deadline:
                err = "".join(self.err)[-2000:]
                raise RuntimeError(f"{self.argv[:4]} not ready (rc {self.p.poll()}): {err}")
            time.sleep(0.02)
        return self.t_ready - self.t_start

    def mark(self) -> None:
        """Start of the measured window for cpu_share()."""
        self.cpu0, self.t0 = cpu_seconds(self.p.pid), time.monotonic()
        self.cpu_last, self.t_last = self.cpu0, self.t0

    def touch(self) -> None:
        """Sample CPU time now (call periodically: a process's CPU time is gone once it exits)."""
        c = cpu_seconds(self.p.pid)
        if c > 0:
            self.cpu_last, self.t_last = c, time.monotonic()

    def cpu_share(self) -> float:
        """Fraction of one core used between mark() and the last touch()."""
        return (self.cpu_last - self.cpu0) / max(1e-9, self.t_last - self.t0)

    def stop(self, sig: int = 2, timeout: float = 60.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        if self._out not in (subprocess.DEVNULL, subprocess.PIPE):
            self._out.close()  # type: ignore[union-attr]
        wait_detached(self.argv)
        return rc

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for the observer to exit by itself (it stops when its targets exit)."""
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self.stop()
        if self._out not in (subprocess.DEVNULL, subprocess.PIPE):
            self._out.close()  # type: ignore[union-attr]
        wait_detached(self.argv)
        return rc


def wait_detached(argv: List[str], timeout: float = 60.0) -> None:
    """`argus probe` hands uprobe removal to a forked child (~0.1 s per probe, done while the child
    exits): wait for that child so the next measurement starts with no uprobe installed. While it
    closes its perf fds the exiting child has already dropped its memory, so its command line reads
    empty: match exiting processes with the observer's name and an empty command line too."""
    import psutil

    name = os.path.basename(argv[0])[:15]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = []
        for p in psutil.process_iter(["cmdline", "name"]):
            try:
                cmd = p.info["cmdline"]
                if cmd == argv or (not cmd and p.info["name"] == name and p.pid != os.getpid()):
                    left.append(p)
            except psutil.Error:
                pass
        if not left:
            return
        time.sleep(0.2)


def machine() -> str:
    mem = 0
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    except (OSError, ValueError, IndexError):
        pass
    load = os.getloadavg()
    return (
        f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs, {mem} GiB, "
        f"Python {platform.python_version()} ({sys.executable}), load average {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f}, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )


def need_root(name: str) -> bool:
    if os.geteuid() != 0:
        print(f"ERROR: {name} loads BPF: run it as root (sudo .venv/bin/python -m benchmarks.{name})")
        return False
    return True
