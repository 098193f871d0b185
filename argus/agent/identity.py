"""Who a process is in its job: job, rank, local rank, world size, host, from /proc/PID/environ.

torchrun sets RANK/LOCAL_RANK/WORLD_SIZE/TORCHELASTIC_RUN_ID; Slurm sets SLURM_*; Open MPI
sets OMPI_COMM_WORLD_*. Flags override everything.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from argus.errors import NoSuchProcess, PermissionDenied


@dataclass(frozen=True)
class Identity:
    job: str
    rank: int  # -1 when unknown
    local_rank: int
    world_size: int
    host: str
    pid: int
    source: str  # which variables gave the rank

    def as_dict(self) -> Dict[str, object]:
        return {
            "job": self.job,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "host": self.host,
            "pid": self.pid,
        }


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for n in names:
        v = env.get(n)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                continue
    return None


def from_environ(
    env: Mapping[str, str], pid: int, host: str, job: Optional[str] = None, rank: Optional[int] = None
) -> Identity:
    """Pure: the identity a launcher gave this process (flags first)."""
    sources = (
        ("torchrun", ("RANK",), ("LOCAL_RANK",), ("WORLD_SIZE",)),
        ("slurm", ("SLURM_PROCID",), ("SLURM_LOCALID",), ("SLURM_NTASKS",)),
        ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_SIZE",)),
        ("pmi", ("PMI_RANK",), ("MPI_LOCALRANKID",), ("PMI_SIZE",)),
    )
    r = lr = ws = None
    src = "none"
    for name, rk, lrk, wsk in sources:
        r = _int(env, *rk)
        if r is not None:
            lr, ws, src = _int(env, *lrk), _int(env, *wsk), name
            break
    if rank is not None:
        r, src = rank, "flag"
    if job is None:
        job = env.get("TORCHELASTIC_RUN_ID") or env.get("ARGUS_JOB")
        if not job and env.get("SLURM_JOB_ID"):
            job = f"slurm-{env['SLURM_JOB_ID']}"
        if not job and env.get("MASTER_ADDR"):
            job = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}"
        job = job or f"pid-{pid}"
    return Identity(
        job=job,
        rank=r if r is not None else -1,
        local_rank=lr if lr is not None else -1,
        world_size=ws if ws is not None else -1,
        host=env.get("ARGUS_HOST") or host,
        pid=pid,
        source=src,
    )


def read_environ(pid: int) -> Dict[str, str]:
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
    out = {}
    for item in raw.split(b"\0"):
        k, eq, v = item.partition(b"=")
        if eq:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def of_pid(
    pid: int, job: Optional[str] = None, rank: Optional[int] = None, host: Optional[str] = None
) -> Identity:
    return from_environ(read_environ(pid), pid, host or socket.gethostname(), job, rank)


def pid_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")
