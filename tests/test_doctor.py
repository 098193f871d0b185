"""`argus doctor` and `argus.hostfacts`: pure checks, rendering, real runs as root and as `nobody`."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path
from typing import Dict, List

import pytest
import redis

from argus import doctor, hostfacts
from argus.doctor import Check, Status, evaluate, failure
from argus.errors import PreconditionsFailed
from argus.hostfacts import CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, Facts
from tests.helpers import nobody_skip_reason, run_argus

FULL_CAPS = 0x1FFFEFFFFFF  # what root has on this kind of machine
MOUNTS_TEXT = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
tracefs /sys/kernel/tracing tracefs rw,relatime 0 0
debugfs /sys/kernel/debug debugfs rw,relatime 0 0
bpf /sys/fs/bpf bpf rw,relatime 0 0
"""
GOOD = Facts(
    euid=0,
    cap_eff=FULL_CAPS,
    bpf_errno=0,
    unprivileged_bpf_disabled="2",
    mounts=hostfacts.parse_mounts(MOUNTS_TEXT),
    uprobe_events=True,
    uprobe_pmu=True,
    btf=True,
    kernel_release="6.18.44-fc-v1098",
    headers_build="/usr/src/linux-headers-6.1.0-57-amd64",
    bcc_version="0.26.0",
    bcc_compile_error="",
    python_version=(3, 11, 2),
    python_executable="/repo/.venv/bin/python",
    target_pythons=(("system", "3.11"), ("pyenv", "3.8.18"), ("pyenv", "3.13.0")),
    redis_error="ConnectionError: refused",
    nvml_error="NVML Shared Library Not Found",
)


def by_name(checks: List[Check]) -> Dict[str, Check]:
    return {c.name: c for c in checks}


# --------------------------------------------------------------------------- parsing


def test_parse_cap_eff() -> None:
    text = "Name:\tpython3\nCapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\nCapBnd:\t000001fffeffffff\n"
    assert hostfacts.parse_cap_eff(text) == FULL_CAPS
    assert hostfacts.parse_cap_eff("Name: x\n") == 0


def test_parse_mounts_and_mounted_at() -> None:
    mounts = hostfacts.parse_mounts(MOUNTS_TEXT + "tracefs /sys/kernel/debug/tracing tracefs rw 0 0\n")
    assert hostfacts.mounted_at(mounts, "tracefs") == ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
    assert hostfacts.mounted_at(mounts, "cgroup2") == []


def test_redact_url_hides_password() -> None:
    assert hostfacts.redact_url("redis://u:s3cret@h:6379/0") == "redis://u:***@h:6379/0"
    assert hostfacts.redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert hostfacts.redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert "s3cret" not in doctor.check_redis("redis://:s3cret@h/0", "down").detail


# --------------------------------------------------------------------------- checks


@pytest.mark.parametrize(
    ("euid", "caps", "status"),
    [
        (0, FULL_CAPS, Status.OK),
        (1000, (1 << CAP_BPF) | (1 << CAP_PERFMON), Status.OK),
        (1000, 1 << CAP_SYS_ADMIN, Status.OK),  # pre-5.8 kernels: SYS_ADMIN covers both
        (1000, 1 << CAP_BPF, Status.FAIL),
        (65534, 0, Status.FAIL),
        (0, 0, Status.FAIL),  # root in an unprivileged container
    ],
)
def test_check_privileges(euid: int, caps: int, status: Status) -> None:
    c = doctor.check_privileges(euid, caps)
    assert c.status is status
    assert (c.fix == "") == (status is Status.OK)


def test_check_privileges_fixes_name_the_way_out() -> None:
    assert "sudo argus doctor" in doctor.check_privileges(65534, 0).fix
    assert "--privileged" in doctor.check_privileges(0, 0).fix


def test_check_bpf_syscall() -> None:
    assert doctor.check_bpf_syscall(0, "2", 0).status is Status.OK
    assert doctor.check_bpf_syscall(None, None, 0).status is Status.WARN
    eperm = doctor.check_bpf_syscall(errno.EPERM, "2", 65534)
    assert eperm.status is Status.FAIL and "EPERM" in eperm.detail and "sudo" in eperm.fix
    assert "--privileged" in doctor.check_bpf_syscall(errno.EPERM, "2", 0).fix
    assert "CONFIG_BPF_SYSCALL" in doctor.check_bpf_syscall(errno.ENOSYS, None, 0).fix


def test_check_lockdown() -> None:
    assert doctor.check_lockdown(None).status is Status.OK
    assert doctor.check_lockdown("[none] integrity confidentiality").status is Status.OK
    assert doctor.check_lockdown("none integrity [confidentiality]").status is Status.WARN


def test_check_tracefs_and_debugfs() -> None:
    assert doctor.check_tracefs(GOOD.mounts).status is Status.OK
    missing = doctor.check_tracefs(hostfacts.parse_mounts("sysfs /sys sysfs rw 0 0\n"))
    assert missing.status is Status.FAIL and "mount -t tracefs" in missing.fix
    assert doctor.check_debugfs(()).status is Status.WARN
    assert doctor.check_debugfs(GOOD.mounts).status is Status.OK


def test_check_uprobes_kprobes_btf() -> None:
    assert doctor.check_uprobes(False, True).status is Status.OK
    assert doctor.check_uprobes(True, False).status is Status.OK
    assert doctor.check_uprobes(False, False).status is Status.FAIL
    assert doctor.check_kprobes(False).status is Status.INFO  # absent on this platform: fine
    assert doctor.check_btf(False).status is Status.WARN


def test_check_headers() -> None:
    other = doctor.check_headers("6.18.44", "/usr/src/linux-headers-6.1.0-57-amd64", False)
    assert other.status is Status.OK and "another kernel" in other.detail
    same = doctor.check_headers("6.1.0-57-amd64", "/usr/src/linux-headers-6.1.0-57-amd64", False)
    assert same.status is Status.OK and "another kernel" not in same.detail
    assert doctor.check_headers("6.18.44", None, True).status is Status.OK
    missing = doctor.check_headers("6.18.44", None, False)
    assert missing.status is Status.FAIL and "scripts/setup.sh" in missing.fix


def test_check_bcc_points_at_the_system_site_packages_venv() -> None:
    assert doctor.check_bcc("0.26.0", None, "/usr/bin/python3").status is Status.OK
    bad = doctor.check_bcc(None, "ModuleNotFoundError: No module named 'bcc'", "/pyenv/bin/python")
    assert bad.status is Status.FAIL
    assert "--system-site-packages" in bad.fix and "/usr/bin/python3" in bad.fix and "never" in bad.fix


def test_check_bcc_compile() -> None:
    assert doctor.check_bcc_compile(None).status is Status.INFO
    assert doctor.check_bcc_compile("").status is Status.OK
    assert doctor.check_bcc_compile("chdir(...): No such file").status is Status.FAIL


def test_redis_and_nvml_are_warnings_not_failures() -> None:
    r = doctor.check_redis("redis://127.0.0.1:1/0", "ConnectionError")
    assert r.status is Status.WARN and "redis-server --port 6379 --save ''" in r.fix
    assert doctor.check_redis("redis://127.0.0.1:1/0", None).status is Status.OK
    n = doctor.check_nvml(None, "NVML Shared Library Not Found")
    assert n.status is Status.WARN and "no NVIDIA driver; GPU metrics channel off" in n.detail
    assert doctor.check_nvml("8 GPU(s), driver 560.35", None).status is Status.OK


def test_check_pythons() -> None:
    assert doctor.check_agent_python((3, 11, 2), "/usr/bin/python3").status is Status.OK
    assert doctor.check_agent_python((3, 8, 18), "/x").status is Status.FAIL
    c = doctor.check_target_pythons((("system", "3.11"), ("pyenv", "3.8.18"), ("pyenv", "3.13.0")))
    assert c.status is Status.OK
    found, unsupported = c.detail.split("; unsupported: ")
    assert "system 3.11" in found and "pyenv 3.13.0" in found and unsupported == "pyenv 3.8.18"
    assert doctor.check_target_pythons((("pyenv", "2.7.18"),)).status is Status.INFO


# --------------------------------------------------------------------------- evaluate / failure


def test_good_machine_has_no_failure() -> None:
    checks = evaluate(GOOD)
    assert not [c for c in checks if c.status is Status.FAIL]
    assert by_name(checks)["redis"].status is Status.WARN
    assert failure(checks, 0) is None
    for c in checks:  # every non-OK row says what to do (INFO rows are informational)
        assert c.fix or c.status in (Status.OK, Status.INFO), c


def test_failure_names_checks_and_hints() -> None:
    bad = dataclasses.replace(GOOD, euid=1000, cap_eff=0, bpf_errno=None, headers_build=None)
    err = failure(evaluate(bad), bad.euid)
    assert isinstance(err, PreconditionsFailed)
    assert err.message == "2 checks failed: privileges, kernel headers"
    assert "sudo argus doctor" in err.hint and "sudo scripts/setup.sh" in err.hint


def test_single_failure_is_singular() -> None:
    err = failure(evaluate(dataclasses.replace(GOOD, uprobe_events=False, uprobe_pmu=False)), 0)
    assert err is not None and err.message == "1 check failed: uprobes"


def test_render_table_and_json() -> None:
    checks = evaluate(dataclasses.replace(GOOD, headers_build=None))
    text = doctor.render_table(checks, width=160)
    for c in checks:
        assert c.name in text
    assert "FAIL" in text and "WARN" in text
    data = json.loads(doctor.render_json(checks))
    assert data["ok"] is False
    assert {row["name"]: row["status"] for row in data["checks"]}["kernel headers"] == "FAIL"


def test_gather_facts_never_raises_and_sees_this_process() -> None:
    facts = hostfacts.gather_facts("redis://127.0.0.1:1/0")  # port 1: nothing listens
    assert facts.euid == os.geteuid()
    assert facts.redis_error is not None
    assert facts.probe_errors == ()
    assert by_name(evaluate(facts))["redis"].status is Status.WARN


# --------------------------------------------------------------------------- real runs


@pytest.mark.bpf
def test_doctor_passes_as_root_on_a_set_up_machine() -> None:
    res = run_argus("doctor", "--redis", "redis://127.0.0.1:1/0", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "probing can work here" in res.stdout
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.redis
def test_doctor_json_sees_a_live_redis(redis_url: str) -> None:
    res = run_argus("doctor", "--json", "--redis", redis_url, timeout=120)
    assert res.returncode in (0, PreconditionsFailed.exit_code), res.stderr
    rows = {row["name"]: row for row in json.loads(res.stdout)["checks"]}
    assert rows["redis"]["status"] == "OK", rows["redis"]


def test_doctor_as_nobody_fails_politely() -> None:
    reason = nobody_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    res = run_argus("doctor", "--redis", "redis://127.0.0.1:1/0", nobody=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == PreconditionsFailed.exit_code, out
    assert "ERROR: " in res.stderr and "HINT: " in res.stderr
    assert "privileges" in res.stderr and "sudo argus doctor" in res.stderr
    assert "Traceback" not in out


@pytest.mark.redis
def test_doctor_connects_with_the_redis_credentials_every_command_uses(tmp_path: Path) -> None:
    """An ACL'd Redis: doctor takes ARGUS_REDIS_PASSWORD like probe and aggregate (it used to connect
    without it and say 'unreachable: AuthenticationError ... start one')."""
    from tests.redisproc import RedisProc

    srv = RedisProc(tmp_path / "redis").start()
    try:
        redis.Redis(port=srv.port).config_set("requirepass", "pw-of-the-test")
        pw = {"ARGUS_REDIS_PASSWORD": "pw-of-the-test"}
        res = run_argus("doctor", "--json", "--redis", srv.url, env=pw)
        rows = {row["name"]: row for row in json.loads(res.stdout)["checks"]}
        assert rows["redis"]["status"] == "OK", rows["redis"]
        res = run_argus("doctor", "--json", "--redis", srv.url)  # no password: said, not a crash
        rows = {row["name"]: row for row in json.loads(res.stdout)["checks"]}
        row = rows["redis"]
        assert row["status"] == "WARN" and "Authentication" in row["detail"], row
    finally:
        srv.stop()
