"""`argus probe --all`: which processes on this host are ranks of a training job.

A rank maps libcuda, libcudart or libnccl; with the Python channel on and a `--match`, a Python
process that maps none of them (a CPU-only job) is one too. Launchers start ranks in many ways:
torchrun and Slurm exec the user's script, `torch.multiprocessing.spawn` runs
`python -c "from multiprocessing.spawn import spawn_main; ..."`, and a `torchrun` inside a Slurm
step puts its ranks two levels under `slurmstepd: [JOB.STEP]` — so `--match` is tried against a
process's command line and every ancestor's.
Two kinds of process that map the libraries are not ranks:

- a *launcher*: it has no rank variable, has not initialised CUDA (no libcuda.so.1 mapped) and
  other candidates are its children (torchrun imports torch, so it maps libnccl; a `mp.spawn`
  parent);
- a *helper*: its parent already uses the GPU (maps libcuda.so.1) and runs the same executable,
  and the child has the parent's rank variable unchanged, or neither has one (a DataLoader
  worker); for Python processes without the libraries, a child with its parent's executable and
  command line (a forked worker).

Everything here reads /proc only; `pick` is pure so the rules test without processes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from argus.agent.identity import RANK_VARS, cmdline

GPU_LIBS = ("libcuda.so", "libcudart.so", "libnccl.so")
LIBCUDA = "libcuda.so.1"
PYTHON_RE = re.compile(r"python[0-9.]*$")
KEEPER = "argus.agent.keeper"  # the agent's child that holds its probes (argus/agent/keeper.py)


@dataclass
class Proc:
    pid: int
    ppid: int
    cmdline: str
    exe: str
    libs: bool  # maps libcuda, libcudart or libnccl
    uses_gpu: bool  # maps libcuda.so.1 (CUDA initialised)
    env: Dict[str, str] = field(default_factory=dict)  # /proc/PID/environ: only what launchers set

    @property
    def python(self) -> bool:
        return bool(PYTHON_RE.search(os.path.basename(self.exe)))


def _own_rank(env: Dict[str, str]) -> Optional[Tuple[str, str]]:
    for _family, var, _l, _w in RANK_VARS:
        if var in env:
            return var, env[var]
    return None


def _read(pid: int) -> Optional[Proc]:
    try:
        maps = open(f"/proc/{pid}/maps").read()
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    libs = any(lib in maps for lib in GPU_LIBS)
    env: Dict[str, str] = {}
    if libs:
        try:
            for item in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                k, eq, v = item.partition(b"=")
                if eq and any(k.decode(errors="replace") == var for _f, var, _l, _w in RANK_VARS):
                    env[k.decode()] = v.decode(errors="replace")
        except OSError:
            pass
    return Proc(pid, int(fields[1]), cmdline(pid), exe, libs, LIBCUDA in maps, env)


def scan() -> Dict[int, Proc]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            p = _read(int(d))
            if p is not None:
                out[p.pid] = p
    return out


def _ancestors(procs: Dict[int, Proc], pid: int) -> List[int]:
    out, seen = [], set()
    p = procs.get(pid)
    while p is not None and p.ppid > 1 and p.ppid not in seen:
        seen.add(p.ppid)
        out.append(p.ppid)
        p = procs.get(p.ppid)
    return out


def _mine(procs: Dict[int, Proc], me: int) -> Set[int]:
    """The agent, its ancestors and its own helpers: its probe keeper (a Python process whose
    parent's command line, the agent's, holds the --match pattern itself) and forks of itself.
    Other children are candidates (a program that started the ranks may look for them)."""
    agent = procs.get(me)
    helpers = {
        p.pid
        for p in procs.values()
        if p.ppid == me and (KEEPER in p.cmdline or (agent is not None and p.cmdline == agent.cmdline))
    }
    return {me, *_ancestors(procs, me), *helpers}


def _helper_of(procs: Dict[int, Proc], p: Proc) -> Optional[int]:
    parent = procs.get(p.ppid)
    if parent is None or parent.exe != p.exe:
        return None
    if parent.uses_gpu and p.libs:
        return parent.pid if _own_rank(p.env) == _own_rank(parent.env) else None
    if not p.libs and not parent.libs and p.cmdline == parent.cmdline:
        return parent.pid
    return None


@dataclass
class Pick:
    pids: List[int]
    launchers: List[int]  # matched, but only the parent of ranks
    helpers: Dict[int, int]  # matched helper pid -> the rank pid it works for


def pick(procs: Dict[int, Proc], match: Optional[str], me: int, python: bool = False) -> Pick:
    """The ranks among `procs` (pure): see the module doc. `python`: the Python channel is on."""
    rx = re.compile(match) if match else None
    skip = _mine(procs, me)

    def matches(p: Proc) -> bool:
        if rx is None or rx.search(p.cmdline):
            return True
        return any(rx.search(procs[a].cmdline) for a in _ancestors(procs, p.pid) if a in procs)

    cpu_too = python and rx is not None  # never every Python process of the host
    cands = [
        p for p in procs.values() if (p.libs or (cpu_too and p.python)) and p.pid not in skip and matches(p)
    ]
    pids = {p.pid for p in cands}
    helpers = {p.pid: h for p in cands if (h := _helper_of(procs, p)) is not None and h in pids}
    workers = [c for c in cands if c.pid not in helpers]
    launchers = sorted(
        p.pid
        for p in cands
        if _own_rank(p.env) is None and not p.uses_gpu and any(c.ppid == p.pid for c in workers)
    )
    ranks = sorted(pids - set(launchers) - set(helpers))
    return Pick(ranks, launchers, helpers)


def candidates(match: Optional[str], python: bool = False) -> Pick:
    return pick(scan(), match, os.getpid(), python)


def suggestions(procs: Dict[int, Proc], me: int, limit: int = 5) -> str:
    """For the HINT when nothing matched: processes that map the libraries, else Python ones."""
    skip = _mine(procs, me)
    gpu = [p for p in procs.values() if p.libs and p.pid not in skip]
    pool = gpu or [p for p in procs.values() if p.pid not in skip and p.python]
    if not pool:
        return "no process on this host maps libcuda/libcudart/libnccl or runs Python"
    kind = (
        "processes that map libcuda/libnccl" if gpu else "no process maps libcuda/libnccl; Python processes"
    )
    shown = "; ".join(f"{p.pid} {p.cmdline[:60]}" for p in sorted(pool, key=lambda p: p.pid)[:limit])
    more = f" (+{len(pool) - limit} more)" if len(pool) > limit else ""
    return f"{kind}: {shown}{more}"
