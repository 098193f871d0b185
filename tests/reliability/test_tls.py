"""Redis over TLS (issue 14): `rediss://` against a redis-server that speaks only TLS, with a CA the
test makes (openssl). An agent publishes a simulated job through it and `argus diagnose` reads it
back; a CA that did not sign the server's certificate, a missing CA file, or plain `redis://` to the
TLS port are one `ERROR:` line and one `HINT:` line saying which, exit 8 (2 for the missing file),
no traceback; an agent given the wrong CA says the fix and keeps tracing (its loss counted)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from argus import redisconf
from argus.sim.launcher import SimConfig
from tests.helpers import run_argus
from tests.probing import probed_run
from tests.redisproc import RedisProc
from tests.test_probe_redis import counters

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> Dict[str, Path]:
    """A CA, a server certificate it signed for 127.0.0.1, and an unrelated CA."""
    d.mkdir(parents=True, exist_ok=True)
    p = {k: d / f"{k}.pem" for k in ("ca", "ca_key", "srv", "srv_key", "other", "other_key")}
    for ca, key, cn in (("ca", "ca_key", "argus-test-ca"), ("other", "other_key", "someone-else")):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={cn}",
                 "-keyout", str(p[key]), "-out", str(p[ca]))  # fmt: skip
    csr, ext = d / "srv.csr", d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
             "-keyout", str(p["srv_key"]), "-out", str(csr))  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(p["ca"]), "-CAkey", str(p["ca_key"]),
             "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(p["srv"]))  # fmt: skip
    return p


class TlsRedis(RedisProc):
    """A redis-server listening with TLS only (`--port 0`), clients not asked for certificates."""

    def __init__(self, workdir: Path, pki: Dict[str, Path]) -> None:
        super().__init__(workdir)
        self.pki = pki

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?ca={self.pki['ca']}"

    def cmd(self) -> List[str]:
        c = [self.exe, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1"]
        c += ["--tls-cert-file", str(self.pki["srv"]), "--tls-key-file", str(self.pki["srv_key"])]
        c += ["--tls-ca-cert-file", str(self.pki["ca"]), "--tls-auth-clients", "no"]
        return [*c, "--save", "", "--appendonly", "no", "--dir", str(self.dir)]

    def admin(self, timeout: float = 2.0) -> Any:
        return redisconf.parse(self.url).client(timeout)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Any:
    if shutil.which("openssl") is None:
        pytest.skip("redis tier: no openssl CLI to make the test's CA")
    srv = TlsRedis(tmp_path / "redis", make_pki(tmp_path / "pki"))
    try:
        srv.start()
    except AssertionError:
        log = (srv.dir / "redis.log").read_text(errors="replace")
        if "tls" in log.lower() and "not" in log.lower():
            pytest.skip(f"redis tier: this redis-server has no TLS: {log[-300:]}")
        raise
    try:
        yield srv
    finally:
        srv.stop()


def _one_error(res: subprocess.CompletedProcess[str]) -> Tuple[str, str]:
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr and len(lines) == 2, res.stderr
    assert lines[0].startswith("ERROR: ") and lines[1].startswith("HINT: "), res.stderr
    return lines[0], lines[1]


def test_tls_mistakes_are_one_error_with_their_fix(tls_redis: TlsRedis) -> None:
    port, pki = tls_redis.port, tls_redis.pki
    # the right CA: connected (no job there yet: a usage error, not a connection error)
    res = run_argus("diagnose", "--redis", tls_redis.url)
    assert res.returncode == 2 and "no job has published" in res.stderr, res.stderr
    other = pki["other"]
    cases = [
        (f"rediss://127.0.0.1:{port}/0?ca={other}", 8, "CERTIFICATE_VERIFY_FAILED", "not signed by the CA"),
        (f"rediss://127.0.0.1:{port}/0", 8, "CERTIFICATE_VERIFY_FAILED", "?ca=/path/ca.pem"),
        (f"redis://127.0.0.1:{port}/0", 8, "reset by peer", "use rediss://"),
        (f"rediss://127.0.0.1:{port}/0?ca={pki['ca']}.missing", 2, "is not a readable file", "PEM file"),
    ]  # fmt: skip
    for url, code, err, hint in cases:
        for cmd in (("diagnose", "--redis", url), ("top", "--once", "--redis", url)):
            res = run_argus(*cmd)
            e, h = _one_error(res)
            assert res.returncode == code and err in e and hint in h, (cmd, res.returncode, res.stderr)


@pytest.mark.bpf
def test_probe_publishes_over_tls_and_diagnose_reads_it(tmp_path: Path, tls_redis: TlsRedis) -> None:
    cfg = SimConfig(ranks=2, steps=40, preset="small", run_dir=str(tmp_path / "job"))
    _job, probe = probed_run(cfg, "--redis", tls_redis.url)
    printed = [d for d in probe.steps() if d["step"] is not None]
    assert f"redis: connected to rediss://127.0.0.1:{tls_redis.port}/0" in probe.stderr
    c = counters(probe.stderr)
    assert c["published"] == len(probe.steps()) > 60 and c["dropped"] == 0 and c["send_errors"] == 0, c
    res = run_argus("diagnose", "--redis", tls_redis.url, "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    (j,) = json.loads(res.stdout)["jobs"]
    assert j["job"] == printed[0]["job"] and j["ranks"] == [0, 1]
    assert json.loads(res.stdout)["stats"]["rank_steps"] == len(probe.steps())  # tail records too
    # ... and the agent given a CA that did not sign the server's certificate traces on, says the fix
    cfg = SimConfig(ranks=1, steps=30, preset="small", run_dir=str(tmp_path / "job2"))
    bad = f"rediss://127.0.0.1:{tls_redis.port}/0?ca={tls_redis.pki['other']}"
    _job, probe = probed_run(cfg, "--redis", bad, "--redis-buffer", "1000")
    assert (
        "CERTIFICATE_VERIFY_FAILED" in probe.stderr
        and "hint: the server's certificate is not signed" in probe.stderr
    )
    n = len([d for d in probe.steps() if d["step"] is not None])
    c = counters(probe.stderr)
    assert n >= 25 and c["published"] == 0 and c["dropped"] == len(probe.steps()), (n, c)
    assert "Traceback" not in probe.stderr
