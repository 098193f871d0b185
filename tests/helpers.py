"""Helpers shared by the tests: run the `argus` CLI in a subprocess, optionally as `nobody`."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple, Union

REPO_ROOT = Path(__file__).resolve().parent.parent
NOBODY = "nobody"


def sigint_as_at_a_terminal() -> None:
    """preexec_fn for a child the test will Ctrl-C: a shell starts background jobs (a CI runner's,
    `cmd &`) with SIGINT ignored, and the child would inherit that and never see the signal."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def argus_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment for a child `argus`: this one, with the repo first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def as_nobody(cmd: Sequence[str]) -> List[str]:
    """`cmd` wrapped to run as user `nobody` with no supplementary groups and no capabilities.

    Needs root. Prefers util-linux `setpriv` (never asks for a password), else `runuser`.
    """
    if shutil.which("setpriv"):
        gid = pwd.getpwnam(NOBODY).pw_gid
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={gid}", "--clear-groups", *cmd]
    if shutil.which("runuser"):
        return ["runuser", "-u", NOBODY, "--", *cmd]
    raise RuntimeError("neither setpriv nor runuser is installed")


def nobody_skip_reason() -> Optional[str]:
    """Why a test cannot run a command as `nobody` here, or None when it can."""
    if os.geteuid() != 0:
        return "switching to user nobody needs root"
    try:
        pwd.getpwnam(NOBODY)
    except KeyError:
        return "no user `nobody` on this machine"
    if not (shutil.which("setpriv") or shutil.which("runuser")):
        return "neither setpriv nor runuser is installed"
    probe = as_nobody([sys.executable, "-c", "import argus.doctor, click, rich"])
    res = subprocess.run(probe, capture_output=True, text=True, env=argus_env(), cwd="/", timeout=60)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        return f"user nobody cannot import argus from {REPO_ROOT} with {sys.executable}: {last}"
    return None


def run_argus(
    *args: str,
    timeout: float = 60.0,
    env: Optional[Mapping[str, str]] = None,
    nobody: bool = False,
    cwd: Union[str, os.PathLike[str], None] = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m argus ARGS`` with this interpreter; text output captured, never raises on rc."""
    cmd: List[str] = [sys.executable, "-m", "argus", *args]
    if nobody:
        cmd = as_nobody(cmd)
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=argus_env(env),
        cwd=str(cwd) if cwd is not None else "/",
    )


def cpython_header_sets(
    versions: Collection[Tuple[int, int]],
) -> List[Tuple[str, Tuple[int, int], Tuple[str, ...]]]:
    """(label, version, include dirs) of every CPython on this machine with internal headers (pyenv
    builds, Debian's 3.11), among `versions`: what offset and layout tests compile against."""
    out: List[Tuple[str, Tuple[int, int], Tuple[str, ...]]] = []
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for prefix in sorted(glob.glob(f"{root}/versions/3.*")):
        ver = os.path.basename(prefix)
        parts = ver.split(".")
        if len(parts) < 2 or not parts[1].isdigit():
            continue
        mm = (3, int(parts[1]))
        inc = f"{prefix}/include/python3.{mm[1]}"
        if mm in versions and os.path.isdir(f"{inc}/internal"):
            out.append((f"pyenv {ver}", mm, (inc,)))
    deb = "/usr/include/python3.11"
    if (3, 11) in versions and os.path.isdir(f"{deb}/internal"):
        out.append(("debian 3.11", (3, 11), (deb, "/usr/include/x86_64-linux-gnu/python3.11")))
    return out


class ArgusProc:
    """`argus ARGS...` in the background (under `prefix`, e.g. `nsenter --net=...`), its merged
    output collected line by line."""

    def __init__(self, *args: str, prefix: Sequence[str] = ()) -> None:
        self.p = subprocess.Popen(
            [*prefix, sys.executable, "-m", "argus", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=argus_env(),
            cwd=str(REPO_ROOT),
        )
        self.lines: List[str] = []
        out = self.p.stdout
        threading.Thread(target=lambda: self.lines.extend(iter(out.readline, "")), daemon=True).start()  # type: ignore[union-attr]

    def wait_for(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in x for x in self.lines):
            assert time.monotonic() < deadline and self.p.poll() is None, (
                f"no {text!r}:\n{''.join(self.lines)}"
            )
            time.sleep(0.05)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
