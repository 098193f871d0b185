"""What the Python channel costs a Python-heavy process, side by side with py-spy, in one run.

    sudo .venv/bin/python -m benchmarks.python_overhead [--quick] [--workload python|switchy] [--markdown]

A worker runs a pure-Python loop (recursive calls, allocation) and reports its iteration count
every 100 ms. For each tool, interleaved with baselines in the same run: the worker's throughput
while the tool samples it, against the mean of the baseline windows just before and after
(overhead = 1 - on/off), and the tool's own CPU time. Tools: `argus probe` with only the Python
channel at 49 and 99 Hz, argus with Python + host channels, and `py-spy record` at 49 and 99 Hz
(default blocking mode, which pauses the process per sample, and --nonblocking).
Workloads: `python` (CPU-bound, rarely switches), `switchy` (sleeps 200 µs every ~1 ms:
thousands of context switches per second, so the sched_switch stack walks are exercised) and `deep`
(`switchy` 40 frames down, the depth of a training loop's stack when it blocks). `--tools argus`
runs only the tools whose name holds that text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from benchmarks._util import sigint_default

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import sys, time
mode = sys.argv[1]
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
def step():
    fib(15)
    return [str(i) for i in range(200)]
def down(n):  # a training loop's depth: its stack is 30-60 frames when it blocks
    return down(n - 1) if n else main()
def main():
    count, last = 0, time.monotonic()
    while True:
        step()
        if mode != "python":
            time.sleep(0.0002)
        count += 1
        now = time.monotonic()
        if now - last >= 0.1:
            last = now
            print(f"{now} {count}", flush=True)
down(40 if mode == "deep" else 0)
"""


def default_python() -> str:
    """pyenv's 3.11 when present: py-spy 0.4 often fails to find the version of Debian's stripped
    python3.11 ("Failed to find python version from target process"); argus reads either."""
    pyenv = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))) / "versions"
    found = sorted(pyenv.glob("3.11.*/bin/python3.11"))
    return str(found[-1]) if found else os.path.realpath(sys.executable)


class Worker:
    def __init__(self, mode: str, exe: str) -> None:
        self.path = Path(tempfile.gettempdir()) / "argus-pyworker.py"
        self.path.write_text(WORKER)
        self.p = subprocess.Popen([exe, str(self.path), mode], stdout=subprocess.PIPE, text=True)
        self.series: List[Tuple[float, int]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            t, c = line.split()
            self.series.append((float(t), int(c)))

    def rate(self, seconds: float) -> Tuple[float, float]:
        """Iterations per second over the next `seconds`: the mean, and the 90th percentile of
        0.5 s sub-windows (the least-contended stretches: on a shared machine other processes'
        load swamps the mean, while a sampler's own cost is paid in every sub-window)."""
        time.sleep(0.2)
        i = len(self.series) - 1
        time.sleep(seconds)
        pts = self.series[i:]
        mean = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
        subs = [(pts[j + 5][1] - pts[j][1]) / (pts[j + 5][0] - pts[j][0]) for j in range(0, len(pts) - 5, 5)]
        subs.sort()
        return mean, subs[int(0.9 * (len(subs) - 1))] if subs else mean

    def stop(self) -> None:
        self.p.kill()
        self.p.wait()


# ---- in-kernel cost: the kernel's own BPF run-time statistics (kernel.bpf_stats_enabled) ---------

SYS_BPF, PROG_GET_NEXT_ID, PROG_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD = 321, 11, 13, 15
PROGRAMS = ("py_on_cpu", "py_walk_native", "sched__sched_sw", "host_on_cpu")  # names cut at 15 chars


def _bpf(cmd: int, attr: bytes) -> Tuple[int, bytes]:
    import ctypes

    buf = ctypes.create_string_buffer(attr, len(attr))
    r = ctypes.CDLL(None, use_errno=True).syscall(SYS_BPF, cmd, buf, len(attr))
    return r, buf.raw


def bpf_programs(names: Optional[Tuple[str, ...]] = PROGRAMS) -> Dict[int, Tuple[str, int, int]]:
    """id -> (name, run_time_ns, run_cnt) of every loaded BPF program named in `names` (None: all)."""
    import ctypes
    import struct

    out: Dict[int, Tuple[str, int, int]] = {}
    pid = 0
    while True:
        r, raw = _bpf(PROG_GET_NEXT_ID, struct.pack("<IIII", pid, 0, 0, 0) + bytes(112))
        if r != 0:
            return out
        pid = struct.unpack_from("<I", raw, 4)[0]
        fd, _ = _bpf(PROG_GET_FD_BY_ID, struct.pack("<IIII", pid, 0, 0, 0) + bytes(112))
        if fd < 0:
            continue
        info = ctypes.create_string_buffer(256)
        _bpf(OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", fd, 256, ctypes.addressof(info)) + bytes(104))
        os.close(fd)
        name = info.raw[64:80].split(b"\0")[0].decode()
        if names is None or name in names:
            run_ns, runs = struct.unpack_from("<QQ", info.raw, 192)  # bpf_prog_info.run_time_ns, run_cnt
            out[pid] = (name, run_ns, runs)


def bpf_stats(on: bool) -> None:
    Path("/proc/sys/kernel/bpf_stats_enabled").write_text("1" if on else "0")


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Tool:
    def __init__(self, name: str, argv: List[str], ready: str) -> None:
        self.name, self.argv, self.ready = name, argv, ready
        self.p: Optional[subprocess.Popen] = None

    def start(self, pid: int) -> None:
        argv = [a.replace("{pid}", str(pid)) for a in self.argv]
        self.p = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
            env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=sigint_default,
        )  # fmt: skip
        self.err: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 60
        if not self.ready:  # py-spy writes its banner only at exit when stderr is not a TTY
            time.sleep(3.0)
        while self.ready and not any(self.ready in line for line in self.err):
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {''.join(self.err)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready: {''.join(self.err)}")
            time.sleep(0.05)
        if self.p.poll() is not None:
            raise RuntimeError(f"{self.name} exited: {''.join(self.err)}")
        time.sleep(1.0)  # let the first drain / first samples settle

    def _read(self) -> None:
        assert self.p is not None and self.p.stderr is not None
        for line in self.p.stderr:
            self.err.append(line)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def tools(quick: bool) -> List[Tool]:
    argus = [
        sys.executable,
        "-m",
        "argus",
        "probe",
        "-p",
        "{pid}",
        "--json",
        "--no-cuda",
        "--no-cudart",
        "--no-nccl",
    ]
    out = [
        Tool("argus python 49 Hz", [*argus, "--no-host", "--python-hz", "49"], "Tracing"),
        Tool("argus python 99 Hz", [*argus, "--no-host", "--python-hz", "99"], "Tracing"),
        Tool("argus python+host 49+19 Hz", [*argus, "--host-channel", "--python-hz", "49"], "Tracing"),
    ]
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if Path(spy).exists():
        rec = [spy, "record", "--pid", "{pid}", "--format", "raw", "--output", os.devnull]
        out += [
            Tool("py-spy 49 Hz", [*rec, "--rate", "49"], ""),
            Tool("py-spy 99 Hz", [*rec, "--rate", "99"], ""),
        ]
        if not quick:
            out.append(Tool("py-spy 99 Hz --nonblocking", [*rec, "--rate", "99", "--nonblocking"], ""))
    return out


def measure(
    mode: str, exe: str, reps: int, window: float, quick: bool, only: str = ""
) -> Dict[str, Dict[str, List[float]]]:
    w = Worker(mode, exe)
    res: Dict[str, Dict[str, List[float]]] = {}
    tool: Optional[Tool] = None
    try:
        time.sleep(1.0)
        for _ in range(reps):
            for tool in [t for t in tools(quick) if only in t.name]:
                before = w.rate(window)
                old = set(bpf_programs())
                tool.start(w.p.pid)
                assert tool.p is not None
                c0 = cpu_seconds(tool.p.pid)
                p0 = {i: v for i, v in bpf_programs().items() if i not in old}  # this tool's programs
                t0 = time.monotonic()
                on = w.rate(window)
                elapsed = time.monotonic() - t0
                cpu = (cpu_seconds(tool.p.pid) - c0) / elapsed
                p1 = bpf_programs()
                tool.stop()
                after = w.rate(window)
                r = res.setdefault(tool.name, {"overhead": [], "p90": [], "cpu": [], "base": [], "bpf": []})
                base = (before[0] + after[0]) / 2
                r["overhead"].append(1 - on[0] / base)
                r["p90"].append(1 - on[1] / ((before[1] + after[1]) / 2))
                r["cpu"].append(cpu)
                r["base"].append(base)
                bpf_ns = 0
                for i, (name, ns, runs) in p0.items():
                    d_ns, d_runs = p1.get(i, (name, ns, runs))[1] - ns, p1.get(i, (name, ns, runs))[2] - runs
                    bpf_ns += d_ns
                    r.setdefault(f"ns/run {name}", []).append(d_ns / d_runs if d_runs else 0.0)
                    r.setdefault(f"runs/s {name}", []).append(d_runs / elapsed)
                r["bpf"].append(bpf_ns / elapsed / 1e9)
    finally:
        if tool is not None:
            tool.stop()
        w.stop()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repetition, 3 s windows, python workload only")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--python", default=default_python(), help="interpreter of the worker")
    ap.add_argument(
        "--workload",
        choices=["python", "switchy", "deep"],
        help="only this workload (default: python, switchy)",
    )
    ap.add_argument(
        "--tools", default="", help="only the tools whose name holds this text, e.g. 'argus python 49'"
    )
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still stop the worker and the tool
    if os.geteuid() != 0:
        print("needs root (BPF, and ptrace for py-spy): sudo .venv/bin/python -m benchmarks.python_overhead")
        return 1
    reps, window = (1, 3.0) if a.quick else (a.reps, a.window)
    modes = [a.workload] if a.workload else ["python"] if a.quick else ["python", "switchy"]
    print(f"# Python channel overhead vs py-spy ({reps} repetition(s), {window:g} s windows, interleaved)\n")
    print(f"worker: {a.python}\n")
    print(
        "| workload | tool | overhead: mean throughput (median) | runs | overhead: p90 sub-window "
        "| tool CPU (% of a core) "
        "| in-kernel BPF (% of a core) | BPF programs: runs/s × ns/run |"
    )
    print("|---|---|---:|---|---:|---:|---:|---|")
    bpf_stats(True)
    try:
        for mode in modes:
            res = measure(mode, a.python, reps, window, a.quick, a.tools)
            for name, r in res.items():
                runs = ", ".join(f"{x * 100:+.1f}%" for x in r["overhead"])
                progs = ", ".join(
                    f"{k[len('runs/s ') :]}: {statistics.median(v):.0f} × "
                    f"{statistics.median(r['ns/run ' + k[len('runs/s ') :]]):.0f} ns"
                    for k, v in r.items()
                    if k.startswith("runs/s ")
                )
                bpf = f"{statistics.median(r['bpf']) * 100:.3f}%" if progs else "—"
                print(
                    f"| {mode} | {name} | {statistics.median(r['overhead']) * 100:+.2f}% | {runs} | "
                    f"{statistics.median(r['p90']) * 100:+.2f}% | "
                    f"{statistics.median(r['cpu']) * 100:.1f}% | {bpf} | {progs or '—'} |"
                )
            sys.stdout.flush()
    finally:
        bpf_stats(False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
