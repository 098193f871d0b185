"""Ranks in their own PID namespace — a container's — probed from the host (issue 16, item 4).

`unshare --pid --fork --mount-proc` starts each process as pid 1 of a new PID namespace with its
own /proc, as a container runtime does. The agent runs on the host: it takes, reports and filters
by host pids (what BPF sees), while everything the process stores about itself is in its own
namespace — above all the interpreter's thread ids, which the Python channel must translate or
lose every phase of the rank. A container with its own files at the paths the host also has (its
image) is emulated with bind mounts in the rank's private mount namespace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from argus.agent import discover, identity, threadscan
from argus.agent.discover import Proc
from argus.probes import cpython
from argus.sim.build import build
from argus.sim.launcher import SimConfig, SimJob
from tests.probing import ProbeProc

# --kill-child: killing unshare kills the namespace's pid 1 too (else it would outlive the test)
UNSHARE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--"]
PYTHON = os.path.realpath(sys.executable)  # the interpreter file (the venv's python is a symlink)
THREADS = (
    "import threading, time\n"
    "for _ in range(2): threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


@cache
def _unshare_missing() -> Optional[str]:
    if os.geteuid() != 0:
        return "not root: unshare --pid needs CAP_SYS_ADMIN"
    if shutil.which("unshare") is None:
        return "no `unshare` (util-linux) on PATH"
    r = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"`unshare --pid --fork --mount-proc` fails here: {r.stderr.strip()[:200]}"
    return None


@pytest.fixture
def unshare() -> None:
    why = _unshare_missing()
    if why:
        pytest.skip(why)


def _in_own_mounts(binds: Dict[str, str]) -> List[str]:
    """A command prefix: a new PID namespace whose private mount namespace has `binds` (copy ->
    path) mounted over the host's files, then exec of the command that follows (as pid 1)."""
    mounts = " && ".join(f"mount --bind '{src}' '{dst}'" for src, dst in binds.items())
    return [*UNSHARE, "sh", "-c", f'{mounts} && exec "$@"', "sh"]


def _child(pid: int, timeout: float = 10.0) -> int:
    """The host pid of the process `unshare --fork` (pid) started: pid 1 of the new namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in os.listdir("/proc"):
            try:
                stat = open(f"/proc/{d}/stat").read() if d.isdigit() else ""
            except OSError:
                continue
            if stat and int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                return int(d)
        time.sleep(0.02)
    raise AssertionError(f"unshare (pid {pid}) started no process")


def _start(prefix: Sequence[str], exe: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([*prefix, exe, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _stop(p: subprocess.Popen[str]) -> None:
    p.kill()  # unshare: --kill-child takes the target with it
    p.wait(timeout=30)


# ---- no BPF ---------------------------------------------------------------------------------------


def test_the_agents_own_helpers_are_never_ranks() -> None:
    """The probe keeper is a Python child of the agent, and the agent's command line holds the
    --match pattern itself: before, `--all --match train.py` traced the keeper as a rank (and the
    agent's fork that finishes detaching would have been one too). Other children of the caller
    still are candidates."""
    agent = "python -m argus probe --all --match train.py"
    py = "/usr/bin/python3"
    procs = {
        p.pid: p
        for p in [
            Proc(10, 1, "python train.py", py, True, True, {"RANK": "0"}),
            Proc(40, 1, agent, py, False, False),
            Proc(41, 40, f"python -m {discover.KEEPER} 5", py, False, False),
            Proc(42, 40, agent, py, False, False),
            Proc(43, 40, "python train.py", py, True, True, {"RANK": "1"}),
        ]
    }
    assert discover.pick(procs, "train.py", me=40, python=True).pids == [10, 43]
    hint = discover.suggestions({k: v for k, v in procs.items() if k not in (10, 43)}, me=40)
    assert "41" not in hint and "42" not in hint, hint


def _interpreters() -> List[str]:
    """The system Python (3.11: native_thread_id) and a pyenv 3.10 (the tid inside glibc's struct
    pthread), when there is one."""
    root = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))) / "versions"
    old = sorted(root.glob("3.10.*/bin/python3.10")) + sorted(root.glob("3.9.*/bin/python3.9"))
    return [PYTHON, *[str(p) for p in old[:1]]]


@pytest.mark.parametrize("exe", _interpreters(), ids=lambda e: os.path.basename(e))
def test_python_threads_and_the_namespace_pid_of_a_containerised_process(unshare: None, exe: str) -> None:
    """The interpreter's thread ids are its namespace's (1, 2, 3): they are translated to the host
    tids BPF and /proc/PID/task use — before, the 3.11 map held 1, 2, 3 (no thread BPF sees) and
    3.10's offset search found nothing, so the Python channel and the stuck-thread scan saw no
    Python thread. The identity carries the pid inside (`ns_pid`)."""
    p = _start(UNSHARE, exe)
    try:
        pid = _child(p.pid)
        tasks = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        assert len(tasks) == 3 and pid in tasks
        interp = cpython.inspect(pid)
        assert interp is not None
        assert set(cpython.ThreadReader(interp).threads()) == tasks
        main = next(t for t in threadscan.scan(pid, [], interp).threads if t.tid == pid)
        assert main.python and main.python[0].startswith("<module>"), main.python
        assert identity.ns_pid(pid) == 1 and identity.ns_pid(os.getpid()) is None
        ident = identity.of_pid(pid)
        assert ident.pid == pid and ident.ns_pid == 1
        d = ident.as_dict()
        assert d["pid"] == pid and d["ns_pid"] == 1
        assert ident.describe().endswith("; pid 1 in its PID namespace")
        assert "ns_pid" not in identity.of_pid(os.getpid()).as_dict()
    finally:
        _stop(p)


def test_the_interpreter_is_read_from_the_containers_own_file(unshare: None, tmp_path: Path) -> None:
    """A container's python at the same path as the host's but another file: the agent reads and
    probes (GC USDT, precise mode) the one the process runs — before, the host's file."""
    own = tmp_path / "python"
    shutil.copy2(PYTHON, own)
    p = _start(_in_own_mounts({str(own): PYTHON}), PYTHON)
    try:
        pid = _child(p.pid)
        lib = cpython.detect(pid)
        assert lib is not None and lib.path == PYTHON
        runs = os.stat(f"/proc/{pid}/exe")
        opened = os.stat(lib.host_path)
        assert (opened.st_dev, opened.st_ino) == (runs.st_dev, runs.st_ino) == lib.inode, lib
        assert os.stat(own).st_ino == runs.st_ino != os.stat(PYTHON).st_ino
    finally:
        _stop(p)


# ---- BPF: the simulated job, each rank in its own PID namespace ------------------------------------


def _namespaced_job(
    tmp: Path, steps: int, prefix: Dict[int, List[str]], env: Optional[Dict[str, str]] = None
) -> SimJob:
    # one simulated host per rank, so each rank gets its own prefix: two containers
    cfg = SimConfig(
        ranks=2,
        steps=steps,
        preset="small",
        ranks_per_host=1,
        run_dir=str(tmp / "job"),
        gate=True,
        extra_env=env or {},
    )
    cfg.host_prefix = prefix
    return SimJob(cfg)


def _check(name: str, probe: ProbeProc, host: Dict[int, int]) -> List[str]:
    """What `probe` printed for the two namespaced ranks (host pid by rank)."""
    out = probe.steps()
    assert {d["pid"] for d in out} == set(host.values()), (name, {d["pid"] for d in out}, host)
    tails = {d["pid"] for d in out if d.get("step_source") == "tail"}
    assert tails == set(host.values()), (name, tails)  # each rank's exit seen, by its host pid
    report = []
    for rank, pid in host.items():
        steps = [d for d in out if d["step"] is not None and d["rank"] == rank]
        assert len(steps) >= 20, (name, rank, len(steps))
        assert all(d["pid"] == pid and d["ns_pid"] == 1 for d in steps), (name, rank)
        assert "pid 1 in its PID namespace" in steps[0]["identity"]["why"]
        py = [d["python"] for d in steps]
        assert all(x["thread"] in (pid, None) for x in py) and any(x["thread"] == pid for x in py)
        phases = {k for x in py for k, v in x["phases"].items() if v}
        assert {"forward", "backward", "data"} <= phases, (name, rank, phases)
        # every collective is walked (1 in 4, weight 4) in backward: only with the thread map right
        walked = sum(x.get("calls", {}).get("backward", {}).get("collectives") == 8 for x in py)
        assert walked >= 0.9 * len(py), (name, rank, walked, len(py))
        report.append(f"{name}: rank {rank} pid {pid} (1 inside): {len(steps)} steps, {sorted(phases)}")
    return report


@pytest.mark.bpf
@pytest.mark.timeout(240)
def test_ranks_in_their_own_pid_namespaces_probed_by_host_pid_and_found_by_all(
    unshare: None, tmp_path: Path
) -> None:
    """Two ranks, each pid 1 of its own PID namespace, probed by one agent with `-p HOSTPID` and by
    another with `--all --match` (on the container runtime's command line, the ranks' parent):
    both ranks' steps under their host pids, ns_pid 1, ranks 0 and 1, their Python phases, and
    their exits; nothing else traced (the agent's keeper neither)."""
    tag = str(tmp_path / "ct")  # only this test's `unshare` command lines hold it
    job = _namespaced_job(tmp_path, 60, {h: [*UNSHARE, "env", f"ARGUS_CONTAINER={tag}"] for h in (0, 1)})
    job.start()
    agents: List[ProbeProc] = []
    try:
        job.wait_loaded()
        host = {r: _child(p) for r, p in job.pids.items()}
        assert all(identity.ns_pid(pid) == 1 for pid in host.values())
        by_pid = ProbeProc(host.values())
        by_all = ProbeProc([], "--all", "--match", re.escape(tag))
        agents = [by_pid, by_all]
        for a in agents:
            a.wait_for("Tracing 2 process(es)", timeout=120)
        job.release()
        job.wait()
        assert by_pid.wait(timeout=60) == 0, by_pid.stderr  # exits by itself: both ranks exited
        deadline = time.monotonic() + 20  # --all stays for new ranks: once both tails are out, stop it
        while time.monotonic() < deadline:
            if {d["pid"] for d in by_all.steps() if d.get("step_source") == "tail"} == set(host.values()):
                break
            time.sleep(0.1)
        by_all.terminate()
        assert by_all.wait(timeout=60) == 0, by_all.stderr
    finally:
        job.stop()
        for a in agents:
            if a.proc.poll() is None:
                a.proc.kill()
    report = _check("-p", by_pid, host) + _check("--all", by_all, host)
    print("\n" + "\n".join(report))


@pytest.mark.bpf
@pytest.mark.timeout(240)
def test_a_container_with_its_own_copies_of_the_libraries(unshare: None, tmp_path: Path) -> None:
    """Each rank's libcuda/libnccl are its own files at the host's paths (a container image). The
    host's files at that path are this test's (the ranks build into ARGUS_CACHE_DIR): no other
    job's ranks use them."""
    built = build().directory
    libdir = tmp_path / "cache" / built.name  # where the ranks load them from
    shutil.copytree(built, libdir)
    prefix = {}
    for h in (0, 1):
        own = tmp_path / f"image{h}"
        shutil.copytree(built, own)
        prefix[h] = _in_own_mounts({str(own): str(libdir)})
    job = _namespaced_job(tmp_path, 30, prefix, {"ARGUS_CACHE_DIR": str(tmp_path / "cache")})
    job.start()
    probe: Optional[ProbeProc] = None
    try:
        job.wait_loaded()
        host = {r: _child(p) for r, p in job.pids.items()}
        probe = ProbeProc(host.values(), "--no-python")
        probe.wait_for("Tracing 2 process(es)", timeout=120)
        job.release()
        job.wait()
        probe.wait_for("no process left to trace", timeout=30)
        steps = [d for d in probe.steps() if d["step"] is not None]
        got = {r: sum(d["rank"] == r for d in steps) for r in (0, 1)}
        assert min(got.values()) >= 10, got
        assert probe.wait(timeout=60) == 0, probe.stderr
    finally:
        job.stop()
        if probe is not None and probe.proc.poll() is None:
            probe.proc.kill()  # failed: its keeper still takes the probes out
