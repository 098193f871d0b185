"""What the agent runs as root: only files root controls, and only the capabilities it still needs.

The agent compiles BPF C from its package's `bpf/` directory and loads it into the kernel as root,
so whoever can write one of those files (or rename one of the directories above them) runs code
in the kernel. `check_trusted()` refuses to load from a path that anyone could change but root,
the user the agent runs as, and the owner of the agent's own Python code (who runs code as root
through it anyway: a developer's checkout run with sudo): every file, the directory and every
directory up to `/`, group- or world-writable ones included, a sticky directory such as `/tmp`
excepted (others cannot rename what they do not own there).

Once the first targets are attached, `drop_capabilities()` lowers the process's effective,
permitted, inheritable, ambient and bounding sets to what the rest of the run still uses:
- CAP_SYS_ADMIN, to open uprobe perf events for ranks found later (`--all`, exec, launch windows):
  the kernel's uprobe PMU asks for it, CAP_PERFMON is not enough (measured on 6.18: EACCES with
  CAP_PERFMON + CAP_BPF); it also covers the BPF commands on the loaded maps and programs;
- CAP_SYS_PTRACE, to read other processes' memory and maps (identity, communicators, CPython);
- CAP_DAC_READ_SEARCH, to open libraries through `/proc/PID/root` whatever their mode;
- CAP_SYSLOG, only with the host channel (kernel stacks): `/proc/kallsyms` shows addresses only to
  it where perf_event_paranoid > 1 (Debian's default is 2 or 3). Without it every kernel address
  read 0, and bcc's kernel symbolizer re-read the whole file for each frame: the agent stalled
  9 s at its first host-channel drain, and a rank that exited meanwhile lost its Python stacks.
Everything else (CAP_NET_ADMIN, CAP_SYS_MODULE, CAP_SETUID, CAP_KILL, ...) is gone for good: not
even an exec'd child gets it back (bounding set), and no-new-privs blocks setuid binaries.
Capabilities belong to a thread: the drop happens before the agent starts any thread of its own,
and `threads_above()` checks that none kept more.
"""

from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Set, Tuple

from argus.errors import PermissionDenied

CAP_DAC_READ_SEARCH = 2
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_SYSLOG = 34
CAP_PERFMON = 38
CAP_BPF = 39
NAMES = {
    CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH",
    CAP_SYS_PTRACE: "CAP_SYS_PTRACE",
    CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
    CAP_SYSLOG: "CAP_SYSLOG",
    CAP_PERFMON: "CAP_PERFMON",
    CAP_BPF: "CAP_BPF",
}

_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]


def last_cap() -> int:
    """The highest capability number this kernel knows (CAP_BPF = 39 from 5.8 on)."""
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return CAP_BPF


def kept(kernel_stacks: bool = False) -> Tuple[int, ...]:
    """The capabilities the agent keeps after attaching (the module's docstring says why each)."""
    return (CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_SYS_ADMIN) + ((CAP_SYSLOG,) if kernel_stacks else ())


def mask(caps: Iterable[int]) -> int:
    m = 0
    for c in caps:
        m |= 1 << c
    return m


def names(m: int) -> str:
    """`CAP_A, CAP_B` for the bits of `m` (numbers for capabilities without a name here)."""
    return ", ".join(NAMES.get(c, f"cap {c}") for c in range(64) if m >> c & 1) or "none"


def cap_eff_of(status: str) -> int:
    """CapEff from a /proc/.../status text."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


@dataclass(frozen=True)
class Dropped:
    before: int  # effective set before
    after: int  # effective set after
    error: Optional[str] = None  # why nothing was dropped

    def describe(self) -> str:
        if self.error:
            return f"warning: kept every capability: {self.error}"
        gone = self.before & ~self.after
        return (
            f"capabilities: kept {names(self.after)} (to attach to ranks found later); "
            f"dropped the other {bin(gone).count('1')}"
        )


def drop_capabilities(keep: Optional[Tuple[int, ...]] = None) -> Dropped:
    """Lower this thread's capability sets (and the bounding set) to `keep` (default: `kept()`).
    Never raises: a failure is reported in the result and the agent goes on as it was."""
    last = last_cap()
    want = mask(kept() if keep is None else keep)
    before = cap_eff_of(Path("/proc/thread-self/status").read_text())
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for c in range(last + 1):  # the bounding set first: it needs CAP_SETPCAP, dropped below
            if not want >> c & 1 and libc.prctl(_PR_CAPBSET_DROP, c, 0, 0, 0) != 0:
                err = ctypes.get_errno()
                if err != 22:  # EINVAL: a capability this kernel does not know
                    raise OSError(err, f"PR_CAPBSET_DROP {c}: {os.strerror(err)}")
        libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"PR_SET_NO_NEW_PRIVS: {os.strerror(err)}")
        have = want & before  # never more than it had
        hdr = _Header(_LINUX_CAPABILITY_VERSION_3, 0)
        data = (_Data * 2)()
        for i in range(2):
            word = have >> (32 * i) & 0xFFFFFFFF
            data[i].effective, data[i].permitted, data[i].inheritable = word, word, 0
        if libc.capset(ctypes.byref(hdr), data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"capset: {os.strerror(err)}")
    except (OSError, AttributeError) as e:
        return Dropped(before, before, str(e))
    return Dropped(before, cap_eff_of(Path("/proc/thread-self/status").read_text()))


def threads_above(limit: int, pid: Optional[int] = None) -> List[int]:
    """Threads of `pid` (default: this process) whose effective set holds more than `limit`."""
    pid = os.getpid() if pid is None else pid
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            eff = cap_eff_of(Path(f"/proc/{pid}/task/{tid}/status").read_text())
        except OSError:
            continue  # the thread ended
        if eff & ~limit:
            out.append(int(tid))
    return out


def untrusted(path: Path, owners: Set[int], above: bool = False) -> Optional[str]:
    """Why `path` could be changed by a user outside `owners` (uids), or None. A directory `above`
    the code may be sticky and writable by all (others cannot rename what is not theirs)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}"
    sticky = above and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
        who = "everyone" if st.st_mode & stat.S_IWOTH else f"group {st.st_gid}"
        return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_trusted(directory: Path, files: Iterable[str], code_owner: Optional[int] = None) -> None:
    """Refuse (PermissionDenied) to load code from `directory` when its files, it, or a directory
    above it could be changed by someone other than root, the agent's user or `code_owner` (default:
    the owner of this package's Python code)."""
    if code_owner is None:
        code_owner = os.stat(Path(__file__).resolve().parent).st_uid
    owners = {0, os.geteuid(), code_owner}
    directory = directory.resolve()
    paths = [(directory / f, False) for f in files] + [(directory, False)]
    for p, above in paths + [(d, True) for d in directory.parents]:
        why = untrusted(p, owners, above)
        if why is not None:
            raise PermissionDenied(
                f"refusing to load BPF code that a user other than root could change: {why}",
                "let only root write there (chown root: PATH; chmod go-w PATH) and retry; "
                "in a checkout, sudo scripts/setup.sh does it",
            )
