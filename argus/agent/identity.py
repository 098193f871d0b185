"""Who a process is in its job: job, rank, local rank, world size, host — and where each came from.

Launchers say it in environment variables: torchrun RANK/LOCAL_RANK/WORLD_SIZE/TORCHELASTIC_RUN_ID,
Slurm SLURM_*, Open MPI OMPI_COMM_WORLD_*, PMIx PMIX_*, MPICH-style PMI_*. A script started by
`torch.multiprocessing.spawn` sets them itself after it started (`os.environ["RANK"] = ...`), or
never (the rank goes to `init_process_group`). So, in this order:

1. flags (`--rank`, `--job`): the user said so;
2. the environment as it is *now*: the C library's `environ` array, read from the process's
   memory (`os.environ[...] =` and `putenv` update it; `/proc/PID/environ` never changes);
3. the rank and size of the largest NCCL communicator the process uses (its world), once the
   tracker has read one (`with_communicator`);
4. `/proc/PID/environ`, when the live array cannot be read.

A rank variable that a spawned process (same executable as its parent) inherited unchanged from
its parent names the parent, not the child — Slurm's SLURM_PROCID in ranks a task spawned — so it
is not taken; the communicator says. The job comes from the launcher's job id, else
MASTER_ADDR:MASTER_PORT, else the parent whose multiprocessing children the ranks are, else the pid.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import struct
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from argus.errors import NoSuchProcess, PermissionDenied
from argus.probes.base import host_path
from argus.probes.cpython import ns_ids
from argus.probes.elf import Elf, ElfError

# where the rank came from, strongest first (see the module doc)
FLAG, LIVE, NCCL, PROC, INHERITED, NONE = "flag", "environ now", "nccl", "/proc environ", "inherited", "none"

MAX_VARS = 8192  # entries of environ read at most
MAX_VAR_BYTES = 128 * 1024
PAGE = 4096


@dataclass(frozen=True)
class Identity:
    job: str
    rank: int  # -1 when unknown
    local_rank: int
    world_size: int
    host: str
    pid: int
    source: (
        str  # the launcher family that gave the rank: torchrun, slurm, openmpi, pmix, pmi, nccl, flag, none
    )
    rank_from: str = NONE  # FLAG | LIVE | NCCL | PROC | INHERITED | NONE
    rank_why: str = "nothing yet (no rank variable)"  # e.g. "RANK in the environment now"
    job_why: str = "its pid"  # e.g. "TORCHELASTIC_RUN_ID"
    # its pid in its own PID namespace (a container's) when that is not this host's: `pid` is always
    # the host's (what -p takes and BPF sees), this one what the container's `ps` shows
    ns_pid: Optional[int] = None

    def as_dict(self) -> Dict[str, object]:
        d: Dict[str, object] = {
            "job": self.job,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "host": self.host,
            "pid": self.pid,
        }
        if self.ns_pid is not None:
            d["ns_pid"] = self.ns_pid
        d["identity"] = {"rank": self.rank_from, "why": self.describe()}
        return d

    def describe(self) -> str:
        """One line for a person: where the rank and the job came from."""
        ns = f"; pid {self.ns_pid} in its PID namespace" if self.ns_pid is not None else ""
        return f"rank from {self.rank_why}; job from {self.job_why}{ns}"

    def with_communicator(self, nranks: int, rank: int) -> Optional[Identity]:
        """The identity the NCCL communicator of `nranks` gives, when it is better than this one
        (no rank from the live environment or a flag, and a larger communicator than any before);
        None when it is not."""
        if not 0 <= rank < nranks:
            return None
        if self.rank_from in (FLAG, LIVE):
            return None
        if self.rank_from == NCCL and nranks <= self.world_size:
            return None
        return dataclasses.replace(
            self,
            rank=rank,
            world_size=nranks,
            source="nccl",
            rank_from=NCCL,
            rank_why=f"its largest NCCL communicator ({nranks} ranks)",
        )


@dataclass(frozen=True)
class Parent:
    """The process that spawned this one, when it runs the same executable (multiprocessing,
    torch.multiprocessing.spawn, a Python launcher)."""

    pid: int
    cmdline: str
    env: Mapping[str, str]
    # the child is a multiprocessing child of it (spawn/forkserver: `--multiprocessing-fork` in its
    # command line; fork: the parent's command line): the two are one program, so one job
    multiprocessing: bool = True


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    v = env.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        return None


# (family, rank variable, local rank variable, world size variable)
RANK_VARS = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmix", "PMIX_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)

# (variable, how the job id is made from it)
JOB_VARS = (
    ("TORCHELASTIC_RUN_ID", "{}"),
    ("ARGUS_JOB", "{}"),
    ("SLURM_JOB_ID", "slurm-{}"),
    ("PMIX_NAMESPACE", "{}"),
    ("OMPI_MCA_ess_base_jobid", "ompi-{}"),
    ("OMPI_MCA_orte_ess_jobid", "ompi-{}"),
)


def _job(env: Mapping[str, str], pid: int, parent: Optional[Parent]) -> Tuple[str, str]:
    for var, fmt in JOB_VARS:
        if env.get(var):
            return fmt.format(env[var]), var
    if env.get("MASTER_ADDR"):
        return f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}", "MASTER_ADDR:MASTER_PORT"
    if parent is not None and parent.multiprocessing:
        return f"pid-{parent.pid}", f"the process that spawned it (pid {parent.pid})"
    return f"pid-{pid}", "its pid"


def from_environ(
    env: Mapping[str, str],
    pid: int,
    host: str,
    job: Optional[str] = None,
    rank: Optional[int] = None,
    where: str = LIVE,
    parent: Optional[Parent] = None,
) -> Identity:
    """Pure: the identity a launcher gave this process. `where` is LIVE or PROC (which copy of the
    environment `env` is); `parent` the process that spawned it, if any (see the module doc)."""
    r = lr = ws = None
    src, rank_from, why = "none", NONE, "nothing yet (no rank variable)"
    for family, rk, lrk, wsk in RANK_VARS:
        r = _int(env, rk)
        if r is None:
            continue
        if parent is not None and parent.env.get(rk) == env.get(rk):
            r, rank_from = None, INHERITED
            why = f"nothing yet ({rk}={env[rk]} is inherited from pid {parent.pid})"
            break
        lr, ws, src, rank_from = _int(env, lrk), _int(env, wsk), family, where
        why = f"{rk} in {'the environment now' if where == LIVE else '/proc/PID/environ'}"
        break
    if rank is not None:
        r, src, rank_from, why = rank, "flag", FLAG, "--rank"
    job_why = "--job"
    if job is None:
        job, job_why = _job(env, pid, parent)
    return Identity(
        job=job,
        rank=r if r is not None else -1,
        local_rank=lr if lr is not None else -1,
        world_size=ws if ws is not None else -1,
        host=env.get("ARGUS_HOST") or host,
        pid=pid,
        source=src,
        rank_from=rank_from,
        rank_why=why,
        job_why=job_why,
    )


# ---- reading a process ---------------------------------------------------------------------------


def _parse_env(items: List[bytes]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for item in items:
        k, eq, v = item.partition(b"=")
        if eq and k:
            out.setdefault(k.decode(errors="replace"), v.decode(errors="replace"))
    return out


def read_environ(pid: int) -> Dict[str, str]:
    """/proc/PID/environ: the environment the process was started with."""
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(
            f"no process with pid {pid}", "check the pid: ps -eo pid,cmd | grep train"
        ) from None
    except PermissionError:
        raise PermissionDenied(
            f"cannot read /proc/{pid}/environ", "run as root: sudo argus probe -p PID"
        ) from None
    return _parse_env(raw.split(b"\0"))


LIBC_RE = re.compile(r"libc\.so\.6|libc-[0-9.]+\.so|libc\.musl-.*\.so.*|ld-musl-.*\.so.*")
ENVIRON_NAMES = ("__environ", "environ", "_environ")
ET_EXEC = 2
# file -> where its `environ` is, relative to its load base (None: not defined there)
_ENVIRON_AT: Dict[Tuple[int, int], Optional[int]] = {}


def _environ_vaddr(path: str, key: Tuple[int, int]) -> Optional[int]:
    if key not in _ENVIRON_AT:
        try:
            elf = Elf(path)
            sym = next((elf.data_symbols[n] for n in ENVIRON_NAMES if n in elf.data_symbols), None)
            first = (
                0 if elf.type == ET_EXEC else min((v for v, _o, _s in elf._loads), default=0) & ~(PAGE - 1)
            )
            _ENVIRON_AT[key] = sym.vaddr - first if sym is not None else None
        except (OSError, ElfError, struct.error):
            _ENVIRON_AT[key] = None
    return _ENVIRON_AT[key]


def _environ_sites(pid: int) -> List[Tuple[int, str]]:
    """(load base, path) of the executable, then of the C library: where the dynamic linker looks
    for `environ` — an executable that references it holds the live copy (a copy relocation), and
    the C library's own then stays at its initial value."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    sites: Dict[str, Tuple[int, str]] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if parts[2:3] != ["00000000"] or not path.startswith("/"):
                    continue
                kind = "exe" if path == exe else "libc" if LIBC_RE.fullmatch(os.path.basename(path)) else ""
                if kind and kind not in sites:
                    sites[kind] = (int(parts[0].split("-")[0], 16), path)
    except OSError:
        pass
    return [sites[k] for k in ("exe", "libc") if k in sites]


class _Reader:
    """Page-wise reads of another process's memory: a string may end just before an unmapped page."""

    def __init__(self, pid: int) -> None:
        self.f = open(f"/proc/{pid}/mem", "rb", buffering=0)

    def read(self, addr: int, n: int) -> bytes:
        out = b""
        while n > 0:
            take = min(n, PAGE - (addr % PAGE))
            try:
                self.f.seek(addr)
                got = self.f.read(take)
            except (OSError, ValueError, OverflowError):
                break
            out += got
            if len(got) < take:
                break
            addr, n = addr + take, n - take
        return out

    def until(self, addr: int, end: bytes, step: int, limit: int) -> bytes:
        """Bytes from `addr` up to the first `end` aligned to `step` (excluded), at most `limit`."""
        out = b""
        while len(out) < limit:
            chunk = self.read(addr + len(out), PAGE - ((addr + len(out)) % PAGE))
            if not chunk:
                return out
            for i in range(0, len(chunk) - step + 1, step):
                if chunk[i : i + step] == end:
                    return out + chunk[:i]
            out += chunk[: len(chunk) // step * step]
        return out[:limit]


def read_live_environ(pid: int) -> Optional[Dict[str, str]]:
    """The C library's `environ` array as it is now in the process's memory; None when no
    `environ` is found (no C library we know), it is not set yet, or the memory cannot be read."""
    try:
        reader = _Reader(pid)
    except OSError:
        return None
    try:
        for base, path in _environ_sites(pid):
            host = host_path(pid, path)
            try:
                st = os.stat(host)
            except OSError:
                continue
            off = _environ_vaddr(host, (st.st_dev, st.st_ino))
            if off is None:
                continue
            with open(host, "rb") as f:
                pie = f.read(18)[16:18] != ET_EXEC.to_bytes(2, "little")
            raw = reader.read((base if pie else 0) + off, 8)
            if len(raw) < 8:
                return None
            (array,) = struct.unpack("<Q", raw)
            if not array:
                # a process in its first microseconds after exec: the C library has not yet set
                # `environ` (clearenv() also empties it, rarer than an agent started with the job)
                return None
            ptrs = reader.until(array, b"\0" * 8, 8, MAX_VARS * 8)
            items = [reader.until(p, b"\0", 1, MAX_VAR_BYTES) for (p,) in struct.iter_unpack("<Q", ptrs) if p]
            return _parse_env(items)
        return None
    finally:
        reader.f.close()


def _stat_ppid(pid: int) -> Optional[int]:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def spawning_parent(pid: int) -> Optional[int]:
    """The parent pid when it runs the same executable as `pid` (it spawned or forked it)."""
    ppid = _stat_ppid(pid)
    if ppid is None or ppid <= 1:
        return None
    try:
        same = os.readlink(f"/proc/{pid}/exe") == os.readlink(f"/proc/{ppid}/exe")
    except OSError:
        return None
    return ppid if same else None


def ns_pid(pid: int) -> Optional[int]:
    """The pid of `pid` in its own PID namespace when it lives in one below this /proc's (a
    container); None when not (or unknown)."""
    ids = ns_ids(f"/proc/{pid}/status")
    return ids[-1] if len(ids) > 1 else None


def environment(pid: int) -> Tuple[Dict[str, str], str]:
    """(the environment, LIVE or PROC): the live one when it can be read."""
    live = read_live_environ(pid)
    if live is not None:
        return live, LIVE
    return read_environ(pid), PROC


def of_pid(
    pid: int, job: Optional[str] = None, rank: Optional[int] = None, host: Optional[str] = None
) -> Identity:
    env, where = environment(pid)
    parent = None
    ppid = spawning_parent(pid)
    if ppid is not None:
        try:
            penv, _ = environment(ppid)
        except (NoSuchProcess, PermissionDenied):
            penv = {}
        pcmd, mine = cmdline(ppid), cmdline(pid)
        parent = Parent(ppid, pcmd, penv, "--multiprocessing-fork" in mine or mine == pcmd)
    ident = from_environ(env, pid, host or socket.gethostname(), job, rank, where, parent)
    inner = ns_pid(pid)
    return dataclasses.replace(ident, ns_pid=inner) if inner is not None else ident


def pid_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")
