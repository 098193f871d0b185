"""What `argus probe` costs: per-hit cost of each probe kind (on the simulated libraries, and on
NVIDIA's real libcuda.so.1 at its implementations vs its exported stubs), and step-time overhead on
the simulated job at its default rates, probe on vs off, in one run.

    sudo .venv/bin/python -m benchmarks.probe_overhead [--quick] [--markdown]

Per-hit: a C driver calls one probed function in a tight loop (2e5 calls), without and with the
real Argus programs attached; cost = median(on) - median(off) over repetitions.
Step time: the 8-rank simulated job (default preset), runs interleaved off/on/off/on; the probe is
the real `argus probe --json` command; its CPU time is reported too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from argus.agent import identity  # noqa: E402
from argus.agent.bpfprog import BpfOptions  # noqa: E402
from argus.agent.session import Session  # noqa: E402
from argus.sim.build import build  # noqa: E402
from argus.sim.launcher import SimConfig, SimJob  # noqa: E402

KINDS: List[Tuple[str, str]] = [
    ("ncclGroupStartOnly", "uprobe only: group-depth counter (ncclGroupStart)"),
    ("cuLaunchKernel", "uprobe: per-kernel counter (the default: launch returns are not probed)"),
    ("cuEventRecord", "uprobe: ring-buffer record (no wakeup) + uretprobe: result"),
    ("cuEventQuery", "uretprobe only: result counted when non-zero"),
    ("ncclGroupStart", "GroupStart+GroupEnd pair: 2 uprobes (counters) + 1 uretprobe"),
    ("ncclGetVersion", "uretprobe on a single-stepped first instruction (reported as slow)"),
]


LAUNCH_LAT = "cuLaunchKernel --launch-latency"


def build_driver() -> Path:
    out = Path(tempfile.gettempdir()) / "argus-hitbench"
    src = REPO / "benchmarks" / "csrc" / "hitbench.c"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-o", str(out), str(src), "-ldl"], check=True)
    return out


def timed_run(argv: List[str], session: Session | None) -> float:
    """Run a C driver that prints "ready", waits for a line, then prints ns per call; attach the
    session's probes to it in between."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline().strip() == "ready"
    if session is not None:
        session.add(p.pid, identity.of_pid(p.pid))
    p.stdin.write("go\n")
    p.stdin.flush()
    ns = float(p.stdout.readline())
    p.wait()
    if session is not None:
        session.remove(p.pid)
        session.drain()
    return ns


def libcuda_site(path: str, symbol: str) -> Tuple[int, int]:
    """(address as argus attaches it, file offset) of `symbol`'s probe in the simulated libcuda at
    `path` (linked at a non-zero base: the two differ)."""
    from argus.probes import libcuda
    from argus.probes.base import MappedLibrary, resolve

    st = os.stat(path)
    lp = resolve(libcuda.CHANNEL, MappedLibrary(path, path, (st.st_dev, st.st_ino)))
    assert lp.elf is not None
    probe = next(p for p in lp.probes if p.spec.symbol == symbol)
    return probe.address, lp.elf.symbols[symbol].offset + probe.plan.offset


def one_run(driver: Path, libdir: Path, fn: str, n: int, session: Session | None) -> float:
    return timed_run([str(driver), str(libdir), fn, str(n)], session)


def per_hit(reps: int, n: int) -> List[Tuple[str, str, float, float, float]]:
    """All 'off' runs happen before any probe exists: once attached, a uprobe traps in every process
    that maps the library, targeted or not (the BPF program then returns at once)."""
    libs = build()
    driver = build_driver()
    off = {fn: [one_run(driver, libs.directory, fn, n, None) for _ in range(reps)] for fn, _ in KINDS}
    session = Session()
    try:
        on = {fn: [one_run(driver, libs.directory, fn, n, session) for _ in range(reps)] for fn, _ in KINDS}
    finally:
        session.close()  # in the foreground: its uprobes must be gone before the next session's runs
    # --launch-latency adds the launch's uretprobe
    session = Session(opts=BpfOptions(launch_latency=True))
    try:
        lat = [one_run(driver, libs.directory, "cuLaunchKernel", n, session) for _ in range(reps)]
    finally:
        session.close(background=True)
    rows = []
    for fn, desc in KINDS:
        mo, mi = statistics.median(off[fn]), statistics.median(on[fn])
        rows.append((fn, desc, mo, mi, mi - mo))
    mo, mi = statistics.median(off["cuLaunchKernel"]), statistics.median(lat)
    rows.insert(2, (LAUNCH_LAT, "uprobe + uretprobe: counter, latency histogram", mo, mi, mi - mo))
    return rows


def build_cudahit() -> Path:
    out = Path(tempfile.gettempdir()) / "argus-cudahit"
    src = REPO / "benchmarks" / "csrc" / "cudahit.c"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-o", str(out), str(src), "-ldl"], check=True)
    return out


def real_launch(driver: Path, lib: Path, n: int, how: str, session: Session | None) -> float:
    return timed_run([str(driver), str(lib), str(n), how], session)


def real_libcuda_per_hit(reps: int, n: int) -> List[Tuple[str, str, float, float, float]]:
    """cuLaunchKernel of NVIDIA's libcuda.so.1 (Debian's libcuda1, tests/nvidia_wheels.py), called
    through the exported symbol and through cuGetProcAddress's pointer: off, probed where Argus
    probes (the implementation behind the dispatch stub), and probed at the exported stub itself
    (what Argus did before it saw through stubs: a RIP-relative first instruction, single-stepped)."""
    from argus.probes import base
    from tests.nvidia_wheels import fetch_libcuda, no_new_device_nodes

    with no_new_device_nodes():  # its cuInit creates /dev/nvidiactl as root
        return _real_libcuda_per_hit(reps, n, fetch_libcuda, base)


def _real_libcuda_per_hit(
    reps: int, n: int, fetch_libcuda: Any, base: Any
) -> List[Tuple[str, str, float, float, float]]:
    lib, why = fetch_libcuda()
    if lib is None:
        print(f"(no real libcuda.so.1: {why})")
        return []
    driver = build_cudahit()
    hows = ("exported", "proc")
    off = {h: [real_launch(driver, lib, n, h, None) for _ in range(reps)] for h in hows}
    on: Dict[str, Dict[str, List[float]]] = {}
    find_stub = base.find_stub
    for where in ("implementation", "stub"):
        base._RESOLVED.clear()
        if where == "stub":  # the baseline: probes at the exported symbols, as before
            base.find_stub = lambda *a: None  # type: ignore[assignment]
        session = Session()
        try:
            on[where] = {h: [real_launch(driver, lib, n, h, session) for _ in range(reps)] for h in hows}
        finally:
            session.close()
            base.find_stub = find_stub
            base._RESOLVED.clear()
    rows = []
    for where in ("implementation", "stub"):
        for h in hows:
            mo, mi = statistics.median(off[h]), statistics.median(on[where][h])
            via = "exported symbol" if h == "exported" else "cuGetProcAddress pointer"
            rows.append((f"probe at the {where}", via, mo, mi, mi - mo))
    return rows


def perf_sample_cost(seconds: float, hz: int) -> Dict[str, Tuple[float, float]]:
    """In-BPF cost of the perf-event (CPU_CLOCK) sampling programs: a busy Python worker, `argus probe`
    with the Python and host channels at `hz`, kernel.bpf_stats_enabled on; program name ->
    (ns per run, runs per second). The timer interrupt and perf bookkeeping around each program run
    are not in these numbers (they are the same for any sampler)."""
    from benchmarks import python_overhead as po

    w = po.Worker("python", po.default_python())
    argv = [sys.executable, "-m", "argus", "probe", "-p", str(w.p.pid), "--json", "--no-cuda", "--no-cudart"]
    argv += ["--no-nccl", "--no-gpu-metrics", "--python-hz", str(hz), "--host-hz", str(hz)]
    from benchmarks._util import Observer

    po.bpf_stats(True)
    obs = None
    try:
        time.sleep(0.5)
        old = set(po.bpf_programs())
        obs = Observer(argv, ready="Tracing")
        obs.wait_ready()
        p0 = {i: v for i, v in po.bpf_programs().items() if i not in old}
        t0 = time.monotonic()
        time.sleep(seconds)
        p1 = po.bpf_programs()
        el = time.monotonic() - t0
    finally:
        if obs is not None:
            obs.stop()
        po.bpf_stats(False)
        w.stop()
    out = {}
    for i, (name, ns, runs) in p0.items():
        _, ns1, runs1 = p1.get(i, (name, ns, runs))
        if runs1 > runs:
            out[name] = ((ns1 - ns) / (runs1 - runs), (runs1 - runs) / el)
    return out


def job_run(
    steps: int, probe: bool, preset: str, extra: Tuple[str, ...] = (), ranks: int = 8
) -> Tuple[float, float]:
    """Median job step time (s), and the probe's CPU use while tracing (fraction of one core; 0 when off)."""
    import psutil

    job = SimJob(SimConfig(ranks=ranks, steps=steps, preset=preset, gate=probe)).start()
    proc = None
    cpu = 0.0
    try:
        if probe:
            job.wait_loaded()
            args = [sys.executable, "-m", "argus", "probe", "--json", *extra]
            for pid in job.pids.values():
                args += ["-p", str(pid)]
            proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(REPO)
            )
            assert proc.stderr is not None
            for line in proc.stderr:
                if "Tracing" in line:
                    break
            ps = psutil.Process(proc.pid)
            t = ps.cpu_times()
            cpu0, w0 = t.user + t.system, time.monotonic()  # after compile and attach
            job.release()
            while any(p.poll() is None for p in job.procs.values()):
                try:
                    t = ps.cpu_times()
                    cpu = (t.user + t.system - cpu0) / (time.monotonic() - w0)
                except psutil.NoSuchProcess:
                    break
                time.sleep(0.2)
        job.wait()
        if proc is not None:
            proc.wait(timeout=60)
        return statistics.median(job.job_step_seconds()[3:]), cpu
    finally:
        job.stop()
        if proc is not None and proc.poll() is None:
            proc.kill()


def step_overhead(steps: int, reps: int, preset: str, ranks: int) -> Dict[str, List[float]]:
    res: Dict[str, List[float]] = {"off": [], "on": [], "cpu": []}
    for _ in range(reps):
        for probe in (False, True):
            t, cpu = job_run(steps, probe, preset, ranks=ranks)
            res["on" if probe else "off"].append(t)
            if probe:
                res["cpu"].append(cpu)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (seconds), not a measurement")
    ap.add_argument("--preset", default="default")
    ap.add_argument(
        "--per-hit-only",
        action="store_true",
        help="skip the step-time table (benchmarks.sim_overhead has it)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("ERROR: needs root (BPF): sudo .venv/bin/python -m benchmarks.probe_overhead")
        return 3
    reps, n, steps, jreps = (1, 20_000, 8, 1) if args.quick else (3, 200_000, 40, 2)

    from benchmarks._util import machine

    print(f"{machine()}\n")
    print(f"# probe per-hit cost ({n} calls per run, median of {reps} runs)\n")
    print("| probed call | what runs per hit | off ns/call | on ns/call | cost ns/hit |")
    print("|---|---|---:|---:|---:|")
    cost: Dict[str, float] = {}
    for fn, desc, off, on, c in per_hit(reps, n):
        cost[fn] = c
        print(f"| {fn} | {desc} | {off:.0f} | {on:.0f} | {c:.0f} |")
    # the real library's sessions add ~30 s (compile, attach, the keeper's removal): not in a smoke run
    real = [] if args.quick else real_libcuda_per_hit(reps, n)
    if real:
        print(
            f"\n# cuLaunchKernel of NVIDIA's real libcuda.so.1 ({n} calls per run, median of {reps} runs)\n"
        )
        print("| where the uprobe is | launched through | off ns/call | on ns/call | cost ns/hit |")
        print("|---|---|---:|---:|---:|")
        for where, via, off, on, c in real:
            print(f"| {where} | {via} | {off:.0f} | {on:.0f} | {c:.0f} |")
        cost["real implementation"] = statistics.median(r[4] for r in real if "implementation" in r[0])
        cost["real stub"] = statistics.median(r[4] for r in real if "stub" in r[0])
    hz = 99
    perf = perf_sample_cost(3.0 if args.quick else 10.0, hz)
    print(f"\n# cost per probe type (ns per hit; perf-event programs at {hz} Hz on a busy Python worker)\n")
    print("| probe type | measured as | ns per hit |")
    print("|---|---|---:|")
    rows = [
        ("uprobe (emulated first instruction)", "ncclGroupStart alone", cost["ncclGroupStartOnly"]),
        ("uretprobe", "cuEventQuery (return probe only)", cost["cuEventQuery"]),
        ("uprobe (a kernel launch, the default)", "cuLaunchKernel", cost["cuLaunchKernel"]),
        ("uprobe + uretprobe (a kernel launch with --launch-latency)", LAUNCH_LAT, cost[LAUNCH_LAT]),
        (
            "ring-buffer record (a uprobe's 48-byte record, no wakeup)",
            "cuEventRecord − cuEventQuery",
            cost["cuEventRecord"] - cost["cuEventQuery"],
        ),
        ("uprobe + uretprobe, single-stepped instruction", "ncclGetVersion", cost["ncclGetVersion"]),
    ]
    names = {"py_on_cpu": "Python stack walk", "host_on_cpu": "native stack (get_stackid)"}
    for name, (ns, rate) in sorted(perf.items()):
        if name in names:
            rows.append((f"perf-event sample: {names[name]} (`{name}`)", f"bpf_stats, {rate:.0f} runs/s", ns))
        elif name.startswith("sched"):
            rows.append((f"sched_switch: off-CPU stack walk (`{name}`)", f"bpf_stats, {rate:.0f} runs/s", ns))
    for what, how, ns in rows:
        print(f"| {what} | {how} | {ns:.0f} |")
    launch = cost["cuLaunchKernel"]
    slow = cost["ncclGetVersion"]
    print("\n# projected overhead at the paper's rates (kernel events per GPU-minute)\n")
    real_impl = cost.get("real implementation", float("nan"))
    real_stub = cost.get("real stub", float("nan"))
    print(
        "| events / GPU-minute | events / s | host CPU per GPU at the launch cost | share of a core "
        "| real libcuda, probed at implementations | real libcuda, probed at its stubs "
        "| if every probe were single-stepped |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rate in (1e4, 3e4, 1e5, 6e5):
        per_s = rate / 60
        print(
            f"| {rate:,.0f} | {per_s:,.0f} | {per_s * launch / 1e3:.0f} µs/s | {per_s * launch / 1e9:.3%} "
            f"| {per_s * real_impl / 1e9:.3%} | {per_s * real_stub / 1e9:.3%} | {per_s * slow / 1e9:.3%} |"
        )
    if args.per_hit_only:
        return 0

    print(
        f"\n# step time, simulated job ({args.preset} preset), {steps} steps per run, "
        f"{jreps} interleaved pairs\n"
    )
    print(
        "| ranks (on 2 cores) | probe off: median step (s) | argus probe (cuda+cudart+nccl) | overhead | "
        "agent CPU (% of a core) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for ranks in (2, 8):
        r = step_overhead(steps, jreps, args.preset, ranks)
        off, on = statistics.median(r["off"]), statistics.median(r["on"])
        print(
            f"| {ranks} | {off:.4f} ({', '.join(f'{x:.4f}' for x in r['off'])}) | {on:.4f} "
            f"({', '.join(f'{x:.4f}' for x in r['on'])}) | {100 * (on - off) / off:+.2f}% | "
            f"{100 * statistics.median(r['cpu']):.1f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
