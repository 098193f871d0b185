"""Per-process tracking: one traced process (its tracker, libraries and where its epochs stand),
whether it is still the program we attached to, and who it is (its rank may become known late).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from argus.agent import identity
from argus.agent.attach import image_of
from argus.agent.identity import Identity
from argus.agent.tracker import RankTracker
from argus.errors import ArgusError
from argus.probes import libnccl
from argus.probes.base import LibraryProbes


@dataclass
class Target:
    pid: int
    identity: Identity
    tracker: RankTracker
    libraries: Dict[str, LibraryProbes]
    final_before: int = 0  # epochs below this are complete in the maps
    seen_epoch: int = 0  # the epoch counter at the previous drain
    alive: bool = True
    flushed: bool = False  # after exit: the tail was emitted
    layout: libnccl.CommLayout = libnccl.UNKNOWN_LAYOUT  # how its communicators are identified
    image: Tuple[Tuple[str, int], ...] = ()  # where its libraries and vdso sit: an exec moves them
    auxv: bytes = b""  # its auxiliary vector when `image` was last compared (an exec changes it)
    image_checked: float = 0.0  # when (monotonic s)


def process_gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie waiting to be reaped."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :][:1] in ("Z", "X")


def read_process(pid: int, addr: int, n: int) -> Optional[bytes]:
    """`n` bytes of the process's memory at `addr` (its communicators: the tracker reads them)."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(addr)
            return f.read(n)
    except (OSError, ValueError, OverflowError):
        return None


# How often the mappings are compared when the auxiliary vector did not change: an exec with address
# randomisation off (gdb, setarch -R) leaves it the same.
IMAGE_RECHECK_S = 60.0


def read_auxv(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/auxv", "rb") as f:
            return f.read()
    except OSError:
        return b""


def execed(targets: Mapping[int, Target], now: Optional[float] = None) -> List[int]:
    """Live targets that ran exec since they were added: a new program in the same pid (its
    address space is new: the libraries and the vdso moved, or are gone). The mappings of a PyTorch
    process run to thousands of lines, so they are compared only when the auxiliary vector (a few
    hundred bytes: the vdso's and the stack's random places) changed, or once a minute."""
    now = time.monotonic() if now is None else now
    out = []
    for pid, t in targets.items():
        if not t.alive or not t.image or process_gone(pid):
            continue
        auxv = read_auxv(pid)
        if auxv and auxv == t.auxv and now - t.image_checked < IMAGE_RECHECK_S:
            continue
        t.auxv, t.image_checked = auxv, now
        image = image_of(pid, t.libraries)
        if image and image != t.image:
            out.append(pid)
    return out


def exited(targets: Mapping[int, Target]) -> List[int]:
    """Targets whose process is gone but that are still tracked."""
    return [pid for pid, t in targets.items() if t.alive and process_gone(pid)]


class Identities:
    """Ranks learned after attach: from the live environment, read again while none is known, or
    from the largest NCCL communicator (argus/agent/identity.py). Changes are kept for the caller
    to say (`take_changes`)."""

    def __init__(self) -> None:
        self._changes: List[Tuple[Target, Identity]] = []
        self._added_at: Dict[int, float] = {}  # pid -> monotonic s of its first identity re-read
        self._reread_at: Dict[int, float] = {}  # pid -> its next identity re-read, after the first minute

    def _change(self, t: Target, new: Identity) -> None:
        self._changes.append((t, t.identity))
        t.identity = t.tracker.id = new

    def learn(self, targets: Mapping[int, Target]) -> None:
        """A target without a rank from its environment takes it from the largest NCCL
        communicator it uses, once the tracker has read one."""
        for t in targets.values():
            w = t.tracker.world_communicator()
            new = t.identity.with_communicator(w.nranks, w.rank) if w is not None else None
            if new is not None:
                self._change(t, new)

    def reread(self, targets: Mapping[int, Target], job: Optional[str], host: Optional[str]) -> None:
        """Targets still without a rank from their environment or a flag: read the live environment
        again (a spawned rank sets RANK after `import torch` mapped libnccl, so an early attach
        sees none yet). The job id follows, since no rank of it was known. Each call for the first
        minute of a target, then every 30 s (~1 ms a read)."""
        now = time.monotonic()
        for t in targets.values():
            if not t.alive or t.identity.rank_from in (identity.FLAG, identity.LIVE, identity.NCCL):
                continue
            added = self._added_at.setdefault(t.pid, now)
            if now - added > 60 and now < self._reread_at.get(t.pid, 0.0):
                continue
            self._reread_at[t.pid] = now + 30
            try:
                new = identity.of_pid(t.pid, job, None, host)
            except ArgusError:
                continue
            if new.rank_from == identity.LIVE:
                self._change(t, new)

    def forget(self, pid: int) -> None:
        self._added_at.pop(pid, None)
        self._reread_at.pop(pid, None)

    def take_changes(self) -> List[Tuple[Target, Identity]]:
        """(target, its identity before) for each target whose identity changed since the last call."""
        out, self._changes = self._changes, []
        return out
