"""Helpers shared by the tests: run the `argus` CLI in a subprocess, optionally as `nobody`."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

REPO_ROOT = Path(__file__).resolve().parent.parent
NOBODY = "nobody"


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
