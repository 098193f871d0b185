"""Redis URLs and credentials: passwords come from the environment or a file, never from argv, and are
never printed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from argus.errors import UsageError
from argus.redisconf import ENV_PASSWORD, ENV_PASSWORD_FILE, ENV_USER, parse
from tests.helpers import run_argus


def test_plain_urls() -> None:
    c = parse("redis://10.0.0.5:6380/3", env={})
    assert (c.scheme, c.host, c.port, c.db) == ("redis", "10.0.0.5", 6380, 3)
    assert c.username is None and c.password is None
    assert parse("redis://localhost", env={}).port == 6379
    assert parse("redis://[::1]:7000/0", env={}).display == "redis://[::1]:7000/0"
    u = parse("unix:///run/redis.sock?db=2", env={})
    assert (u.path, u.db) == ("/run/redis.sock", 2)
    assert u.client_kwargs()["unix_socket_path"] == "/run/redis.sock"


def test_tls_options(tmp_path: Path) -> None:
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "c.pem", "k.pem"))
    for f in (ca, cert, key):
        f.write_text("-----BEGIN CERTIFICATE-----\n")
    c = parse(f"rediss://cache.example:6380/0?ca={ca}&cert={cert}&key={key}", env={})
    kw = c.client_kwargs()
    assert kw["ssl"] and kw["ssl_cert_reqs"] == "required" and kw["ssl_ca_certs"] == str(ca)
    assert (kw["ssl_certfile"], kw["ssl_keyfile"]) == (str(cert), str(key))
    # a file that is not there is the user's typo (exit 2), not an unreachable Redis (exit 8)
    with pytest.raises(UsageError, match=r"key=/nonexistent\.key is not a readable file"):
        parse(f"rediss://h/0?ca={ca}&cert={cert}&key=/nonexistent.key", env={})
    assert parse("rediss://h/0?verify=no", env={}).client_kwargs()["ssl_cert_reqs"] == "none"
    assert "ssl" not in parse("redis://h/0", env={}).client_kwargs()


@pytest.mark.parametrize(
    "url, words",
    [
        ("redis://user:hunter2@h:6379/0", ["password", ENV_PASSWORD]),
        ("redis://:hunter2@h:6379/0", ["password"]),
        ("http://h:6379", ["scheme"]),
        ("h:6379", ["scheme"]),
        ("redis://h:99999/0", ["port"]),
        ("redis://h:6379/x", ["database"]),
        ("redis:///0", ["host"]),
        ("redis://h/0?ca=/x", ["rediss"]),
        ("rediss://h/0?bogus=1", ["bogus"]),
        ("rediss://h/0?verify=maybe", ["verify"]),
        ("unix://", ["socket path"]),
    ],
)
def test_bad_urls_are_usage_errors_that_never_echo_the_password(url: str, words: list) -> None:
    with pytest.raises(UsageError) as e:
        parse(url, env={})
    text = f"{e.value.message} {e.value.hint}"
    assert "hunter2" not in text
    for w in words:
        assert w in text


def test_credentials_from_env_and_file(tmp_path: Path) -> None:
    c = parse("redis://h/0", env={ENV_USER: "argus", ENV_PASSWORD: "s3cret"})
    assert (c.username, c.password) == ("argus", "s3cret")
    assert "s3cret" not in repr(c) and "s3cret" not in str(c) and "s3cret" not in c.display
    assert c.display == "redis://argus@h:6379/0"
    assert parse("redis://bob@h/0", env={}).username == "bob"  # a user name is not a secret
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    pw.chmod(0o600)
    c = parse("redis://h/0", env={ENV_PASSWORD_FILE: str(pw), ENV_PASSWORD: "ignored"})
    assert c.password == "from-file" and not c.warnings
    pw.chmod(0o644)
    assert "chmod 600" in parse("redis://h/0", env={ENV_PASSWORD_FILE: str(pw)}).warnings[0]
    with pytest.raises(UsageError, match=ENV_PASSWORD_FILE):
        parse("redis://h/0", env={ENV_PASSWORD_FILE: str(tmp_path / "missing")})


def test_a_password_file_readable_by_our_own_group_only_is_not_warned_about(tmp_path: Path) -> None:
    """A Kubernetes Secret mounted for a non-root pod is readable through its fsGroup (0440): that
    group is the process's own, not 'other users'. Another group's access is warned about."""
    pw = tmp_path / "pw"
    pw.write_text("x\n")
    pw.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(pw, -1, os.getegid())
    env = {ENV_PASSWORD_FILE: str(pw)}
    assert parse("redis://h/0", env=env).warnings == []
    if os.geteuid() != 0:
        pytest.skip("giving the file another group needs root")
    other = next(g for g in range(4242, 70000) if g != os.getegid() and g not in os.getgroups())
    os.chown(pw, -1, other)
    assert "chmod 600" in parse("redis://h/0", env=env).warnings[0]


def test_probe_refuses_a_password_in_the_url_before_doing_anything() -> None:
    res = run_argus("probe", "-p", str(os.getpid()), "--redis", "redis://u:hunter2@127.0.0.1:1/0")
    assert res.returncode == 2, res.stderr
    assert "ERROR: " in res.stderr and "HINT: " in res.stderr and "Traceback" not in res.stderr
    assert "hunter2" not in res.stderr + res.stdout
    res = run_argus("probe", "-p", str(os.getpid()), "--redis", "htp://127.0.0.1")
    assert res.returncode == 2 and "unsupported scheme" in res.stderr


def test_replay_usage_errors(tmp_path: Path) -> None:
    res = run_argus("replay", "--redis", "redis://127.0.0.1:1/0")
    assert res.returncode == 2 and "FILE or --synthetic" in res.stderr and "HINT: " in res.stderr
    res = run_argus("replay", "--synthetic", "8by3", "--redis", "redis://127.0.0.1:1/0")
    assert res.returncode == 2 and "RANKSxSTEPS" in res.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"job": "x"}\n')
    res = run_argus("replay", str(bad), "--redis", "redis://127.0.0.1:1/0")
    assert res.returncode == 9 and f"{bad}:1" in res.stderr, res.stderr
    res = run_argus("replay", "--help")
    assert res.returncode == 0 and "Examples:" in res.stdout
