"""What the agent runs as root (issue 14, item 8; argus/agent/privs.py): it loads no BPF code a
user other than root could change, and once attached it keeps only the capabilities attaching to
ranks found later needs; its Redis password is never on its command line or in its output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from argus.agent import privs
from argus.agent.bpfprog import BPF_DIR
from argus.errors import PermissionDenied
from argus.rediskeys import k_steps
from tests.helpers import REPO_ROOT, run_argus
from tests.probing import ProbeProc
from tests.reliability.test_security import HOST_AGENT_ACL, _user
from tests.standins.build import build
from tests.test_probe import check_error

TRAIN_PY = REPO_ROOT / "tests" / "standins" / "train.py"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown and capabilities need root")


def _tree(tmp_path: Path) -> Path:
    code = tmp_path / "pkg" / "bpf"
    code.mkdir(parents=True)
    for p in (tmp_path, tmp_path / "pkg", code):
        p.chmod(0o755)
    (code / "x.bpf.c").write_text("int x;\n")
    (code / "x.bpf.c").chmod(0o644)
    return code


def _refused(code: Path, owner: int = 0) -> str:
    with pytest.raises(PermissionDenied) as e:
        privs.check_trusted(code, ["x.bpf.c"], code_owner=owner)
    assert e.value.exit_code == 3 and e.value.hint
    return str(e.value)


@needs_root
def test_bpf_code_others_could_change_is_refused(tmp_path: Path) -> None:
    code = _tree(tmp_path)
    privs.check_trusted(code, ["x.bpf.c"], code_owner=0)  # root's, 644 under /tmp (sticky): loaded
    src = code / "x.bpf.c"
    src.chmod(0o646)
    assert "x.bpf.c is writable by everyone (mode 646)" in _refused(code)
    src.chmod(0o664)
    assert "writable by group" in _refused(code)
    src.chmod(0o644)
    os.chown(src, 1000, 1000)
    assert "x.bpf.c is owned by uid 1000" in _refused(code)
    privs.check_trusted(code, ["x.bpf.c"], code_owner=1000)  # its Python code is uid 1000's anyway
    os.chown(src, 0, 0)
    (tmp_path / "pkg").chmod(0o777)  # a directory above: whoever can write it can swap bpf/
    assert "pkg is writable by everyone" in _refused(code)
    (tmp_path / "pkg").chmod(0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    privs.check_trusted(code, ["x.bpf.c"], code_owner=0)
    code.chmod(0o1777)  # but the code's own directory may not be writable at all
    assert "bpf is writable by everyone" in _refused(code)


def _rank(run_dir: Path, job: str) -> subprocess.Popen:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(STANDIN_LIBDIR=str(build()), RANK="0", WORLD_SIZE="1", TORCHELASTIC_RUN_ID=job)
    run_dir.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(
        [sys.executable, str(TRAIN_PY), "--steps", "3000", "--run-dir", str(run_dir)],
        env=env,
        cwd=run_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while "libnccl.so.2" not in Path(f"/proc/{p.pid}/maps").read_text():
        assert p.poll() is None and time.monotonic() < deadline, "the stand-in rank did not start"
        time.sleep(0.05)
    return p


def _stop(p: Optional[subprocess.Popen]) -> None:  # type: ignore[type-arg]
    if p is not None and p.poll() is None:
        p.kill()
        p.wait(timeout=10)


@pytest.mark.bpf
@needs_root
@pytest.mark.timeout(120)
def test_the_agent_refuses_bpf_code_others_could_change(tmp_path: Path) -> None:
    rank = _rank(tmp_path, "untrusted-code")
    header = BPF_DIR / "argus.h"
    mode = header.stat().st_mode
    try:
        header.chmod(mode | 0o002)
        res = run_argus("probe", "-p", str(rank.pid), "-d", "2s", timeout=60)
    finally:
        header.chmod(mode)
        _stop(rank)
    check_error(res, 3, "refusing to load BPF code", "argus.h is writable by everyone", "chmod go-w")


def _status(pid: int) -> Dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())


@pytest.mark.bpf
@pytest.mark.redis
@needs_root
@pytest.mark.timeout(150)
def test_after_attaching_the_agent_keeps_three_capabilities_and_still_attaches_new_ranks(
    tmp_path: Path, redis_client: Any, redis_url: str
) -> None:
    job, pw = "privs-job", "s3cret-agent-pw-7f"
    _user(redis_client, "argus-agent-privs", HOST_AGENT_ACL.format(pw=pw))
    redis_client.delete(k_steps(job))
    first = _rank(tmp_path / "a", job)
    second = None
    env = {"ARGUS_REDIS_USERNAME": "argus-agent-privs", "ARGUS_REDIS_PASSWORD": pw}
    probe = ProbeProc([], "--all", "--match", str(tmp_path), "--no-python", "--redis", redis_url, env=env)
    try:
        probe.wait_for("capabilities: kept CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_SYS_ADMIN")
        st = _status(probe.proc.pid)
        want = privs.mask(privs.kept())
        for k in ("CapEff", "CapPrm", "CapBnd"):
            assert int(st[k], 16) == want, (k, st[k])
        assert int(st["CapInh"], 16) == 0 and int(st["CapAmb"], 16) == 0 and st["NoNewPrivs"].strip() == "1"
        # every thread, the Redis sender's and the BPF readers' included (they start after the drop)
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{probe.proc.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert privs.threads_above(want, probe.proc.pid) == []
        # a rank started after the drop: found by the --all scan, attached, stepping
        second = _rank(tmp_path / "b", job)
        probe.wait_for(f"pid {second.pid}: rank 0 of job {job}", timeout=30)
        deadline = time.monotonic() + 30
        while not any(s["pid"] == second.pid and s.get("step") is not None for s in probe.steps()):
            assert time.monotonic() < deadline, probe.stderr
            time.sleep(0.2)
        assert "cannot attach" not in probe.stderr and "Invalid argument" not in probe.stderr, probe.stderr
        deadline = time.monotonic() + 20
        while redis_client.xlen(k_steps(job)) < 5:
            assert time.monotonic() < deadline, f"no summaries in Redis: {probe.stderr}"
            time.sleep(0.2)
        cmdline = Path(f"/proc/{probe.proc.pid}/cmdline").read_bytes().decode()
        assert pw not in cmdline
    finally:
        probe.terminate()
        rc = probe.wait(timeout=60)
        _stop(first)
        _stop(second)
        redis_client.execute_command("ACL", "DELUSER", "argus-agent-privs")
    assert rc == 0, probe.stderr
    assert pw not in probe.stderr and not any(pw in line for line in probe.out)
