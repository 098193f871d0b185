"""A second process that holds a copy of every uprobe the agent attached, so that they are always
taken out of the training processes, even when the agent is killed with SIGKILL.

Why: the kernel removes a uprobe (puts the original byte back over its int3 in every process)
when the last file of its perf event closes. When that last close happens in a task that is
dying of SIGKILL, the page lookup it needs fails with EINTR and the kernel gives up: dmesg says
"uprobe: python:PID failed to unregister, leaking uprobe" and the int3 stays in the training
process until it exits, one trap per call of that function (measured on 6.18: cuLaunchKernel,
the hottest probe, left behind in about half of the SIGKILLs). A file closed by a process that
exits normally is always removed.

So the agent sends each perf fd here (SCM_RIGHTS) right after attaching it and says when it
detaches one. The keeper only waits on its socket: when the agent is gone, however it went, the
socket reads EOF and the keeper closes its copies in an ordinary exit. That also takes the slow
part of detaching off the agent's exit (each removal waits ~0.11 s for an RCU grace period).

The keeper needs no capability (closing a file needs none): it drops them all at start. It runs
in its own session, so a terminal's Ctrl-C or hangup reaches only the agent, and it ignores
SIGINT; SIGTERM makes it close everything and exit, which is also a clean removal. Only a
SIGKILL of both processes can leak a probe, as it could before.

Messages (one per sendmsg, newline-free ASCII): `+NAME` with one fd attached: hold it under
NAME (replacing an older one of that name); `-NAME`: close the copy held under NAME.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Union

_MAX_MSG = 4096


def _name(name: Union[str, bytes]) -> bytes:
    """bcc names its events in bytes (str in some versions)."""
    return name if isinstance(name, bytes) else name.encode()


class Keeper:
    """The agent's side: start the keeper process and keep it in step with bcc's `uprobe_fds`."""

    def __init__(self) -> None:
        self._sock: Optional[socket.socket] = None
        self._sent: Dict[Union[str, bytes], int] = {}  # name -> the agent's fd number when it was sent
        self.proc: Optional[subprocess.Popen] = None
        self.error: Optional[str] = None

    def start(self) -> bool:
        """Start the keeper; False (and `error`) when it cannot run: the agent goes on without it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            null = subprocess.DEVNULL
            # `-m` puts the working directory first on sys.path: run from `/`, with this argus's
            # directory on PYTHONPATH, so root never imports an `argus` planted where it was started
            pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
            pypath = os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")]))
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "argus.agent.keeper", str(theirs.fileno())],
                cwd="/",
                env=dict(os.environ, PYTHONPATH=pypath),
                pass_fds=(theirs.fileno(),),
                stdin=null,
                stdout=null,
                stderr=null,  # it must not hold the pipes of whoever reads the agent's output
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            self.error = f"cannot start the probe keeper: {e}"
            return False
        finally:
            theirs.close()
        self._sock = ours
        return True

    def sync(self, fds: Mapping[Union[str, bytes], int]) -> None:
        """Send the fds in `fds` (bcc's event name -> fd) not sent yet; drop those no longer in it."""
        if self._sock is None:
            return
        try:
            for name in [n for n in self._sent if fds.get(n) != self._sent[n]]:
                self._sock.send(b"-" + _name(name))
                del self._sent[name]
            for name, fd in fds.items():
                if name not in self._sent:
                    socket.send_fds(self._sock, [b"+" + _name(name)], [fd])
                    self._sent[name] = fd
        except OSError as e:  # the keeper died: the probes are ours alone again, as without it
            self.error = f"the probe keeper stopped: {e}"
            self._sock.close()
            self._sock = None

    def holds_all(self, fds: Mapping[Union[str, bytes], int]) -> bool:
        """Whether every fd in `fds` has a copy in a live keeper (then ours may close fast)."""
        return self._sock is not None and all(self._sent.get(n) == fd for n, fd in fds.items())

    def release(self) -> None:
        """Let go: the keeper closes its copies (slowly) after we are gone, or now if we live on."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._sent.clear()

    def wait(self, timeout: float = 120.0) -> None:
        """After `release`: until the keeper has closed its copies (the probes are out of the job)."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass


def serve(fd: int) -> int:
    """The keeper process: hold what arrives on socket `fd` until EOF, then close it all."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the agent, which then lets go
    signal.signal(signal.SIGTERM, lambda *_: _close_all_and_exit())
    signal.signal(signal.SIGHUP, lambda *_: _close_all_and_exit())
    try:
        from argus.agent import privs

        privs.drop_capabilities(keep=())
    except Exception:  # holding files needs no capability, and dropping them is only hygiene
        pass
    sock = socket.socket(fileno=fd)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 1)
        except InterruptedError:
            continue
        except OSError:
            break
        if not msg:
            break  # the agent is gone, or let go
        name = msg[1:].decode(errors="replace")
        if msg[:1] == b"+" and fds:
            old = _HELD.pop(name, None)
            if old is not None:
                close_fds([old])
            _HELD[name] = fds[0]
            close_fds(fds[1:])
        elif msg[:1] == b"-":
            old = _HELD.pop(name, None)
            if old is not None:
                close_fds([old])
        else:
            close_fds(fds)
    _close_all_and_exit()
    return 0


_HELD: Dict[str, int] = {}


def close_fds(fds: List[int]) -> None:
    for f in fds:
        try:
            os.close(f)
        except OSError:
            pass


def _close_all_and_exit() -> None:
    held = list(_HELD.values())
    _HELD.clear()
    close_fds(held)  # each close removes a uprobe, in a task no fatal signal is pending on
    os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
