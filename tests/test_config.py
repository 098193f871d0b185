"""The TOML config file every command reads (argus/conffile.py): what it sets, what wins over it,
and the one-line errors a mistake in it gives. Checked against the real click commands; the
`redis` tests run `argus` as a process against a real Redis."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Dict

import click
import pytest
import redis

from argus import conffile
from argus.cli import cli, main
from argus.errors import EXIT_CODES, ConfigError
from tests.helpers import run_argus

SITE = """
[redis]
url = "redis://10.0.0.5:6379/0"
username = "agent"
password_file = "/etc/argus/agent.pw"

[probe]
all = true
no-python = true
launch_steps = "2/60"
interval = "2s"

[aggregate]
phases = "fwd,bwd,opt,grad_sync"

[sim.run]
ranks = 4
inject = ["straggler:rank=1,factor=1.3"]
"""


def build(text: str, tmp_path: Path) -> conffile.Config:
    f = tmp_path / "argus.toml"
    f.write_text(text)
    return conffile.load(cli, str(f), {})


def error(text: str, tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        build(text, tmp_path)
    return f"{e.value.message} | {e.value.hint}"


def test_a_site_file_sets_each_command_and_redis_everywhere(tmp_path: Path) -> None:
    cfg = build(SITE, tmp_path)
    dm: Dict[str, Any] = cfg.default_map
    probe = {p.name: p for p in cli.commands["probe"].params}
    assert set(dm["probe"]) == {"no_python", "launch_steps", "interval", "redis_url"} | {
        n for n, p in probe.items() if "--all" in p.opts
    }, dm["probe"]
    assert dm["probe"]["interval"] == "2s" and dm["probe"]["launch_steps"] == "2/60"
    run = {o: p.name for p in cli.commands["sim"].commands["run"].params for o in p.opts}  # type: ignore[attr-defined]
    assert dm["sim"]["run"]["ranks"] == 4
    assert dm["sim"]["run"][run["--inject"]] == ["straggler:rank=1,factor=1.3"]
    assert dm["aggregate"]["phases"] == "fwd,bwd,opt,grad_sync"
    # every command that takes --redis gets the site's Redis, whatever its parameter is called
    with_redis = [
        name
        for name, cmd in cli.commands.items()
        if any(isinstance(p, click.Option) and "--redis" in p.opts for p in cmd.params)
    ]
    assert {"probe", "aggregate", "alerts", "top", "report", "diagnose", "doctor"} <= set(with_redis)
    for name in with_redis:
        opt = next(p for p in cli.commands[name].params if "--redis" in p.opts)
        assert dm[name][opt.name] == "redis://10.0.0.5:6379/0", name
    assert cfg.env == {"ARGUS_REDIS_USERNAME": "agent", "ARGUS_REDIS_PASSWORD_FILE": "/etc/argus/agent.pw"}


def test_a_command_table_may_name_its_own_redis(tmp_path: Path) -> None:
    cfg = build('[redis]\nurl = "redis://a:1/0"\n[top]\nredis = "redis://b:2/0"\n', tmp_path)
    assert cfg.default_map["top"]["redis_url"] == "redis://b:2/0"
    assert cfg.default_map["alerts"]["redis_url"] == "redis://a:1/0"


@pytest.mark.parametrize(
    "text, says",
    [
        ("[probe]\nintervall = '2s'\n", "[probe] intervall is not an option of `argus probe` | its "),
        ("[probe]\ninterval = 'soon'\n", "[probe] interval = 'soon': 'soon' is not a duration"),
        ("[probe]\nrank = 'two'\n", "[probe] rank = 'two': 'two' is not a valid integer"),
        ("[sim.run]\ninject = 'straggler:rank=1'\n", "[sim.run] inject = 'straggler:rank=1'"),
        ("[prob]\nall = true\n", "[prob] is not an argus command | tables: [redis], aggregate,"),
        ("[sim]\nrun = 3\n", "sim.run is not a table of options"),
        ("probe = 3\n", "probe is not a table of options"),
        ("[redis]\npassword = 'hunter2'\n", "[redis] password: a password is never kept in the config file"),
        ("[redis]\nurl = 'redis://u:pw@h:1/0'\n", "[redis] url: "),
        ("[redis]\nurl = 'http://h/'\n", "[redis] url: "),
        ("[redis]\nport = 6379\n", "[redis] port = 6379 is not a known string key"),
        ("[probe\nall = true\n", "is not valid TOML: "),
    ],
)
def test_a_mistake_is_one_error_naming_the_file_and_key(text: str, says: str, tmp_path: Path) -> None:
    got = error(text, tmp_path)
    assert says in got and str(tmp_path / "argus.toml") in got, got
    assert "hunter2" not in got and ":pw@" not in got


def test_the_file_is_found_and_a_named_file_must_exist(tmp_path: Path) -> None:
    assert conffile.locate(None, {}) in (None, conffile.DEFAULT_PATH)
    assert conffile.locate(None, {"ARGUS_CONFIG": "/x.toml"}) == "/x.toml"
    assert conffile.locate(None, {"ARGUS_CONFIG": ""}) is None  # empty: no file, not even the default
    assert conffile.locate("/y.toml", {"ARGUS_CONFIG": "/x.toml"}) == "/y.toml"
    with pytest.raises(ConfigError, match="No such file"):
        conffile.load(cli, str(tmp_path / "absent.toml"), {})
    big = tmp_path / "big.toml"
    big.write_text("# x\n" * (conffile.MAX_BYTES // 4 + 1))
    with pytest.raises(ConfigError, match="over"):
        conffile.load(cli, str(big), {})


def test_every_option_has_its_own_environment_variable() -> None:
    names: Dict[str, str] = {}
    for key, cmd in conffile._commands(cli):
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.is_eager and not p.hidden:
                prefix = "ARGUS_" + "_".join(key).replace("-", "_").upper()
                assert isinstance(p.envvar, str) and p.envvar.startswith(prefix), p
                assert p.envvar not in names, (p.envvar, names.get(p.envvar), key)
                names[p.envvar] = " ".join(key)
    assert names["ARGUS_PROBE_INTERVAL"] == "probe" and names["ARGUS_ALERTS_REDIS"] == "alerts"
    assert names["ARGUS_SIM_RUN_RANKS"] == "sim run" and names["ARGUS_PROBE_NO_PYTHON"] == "probe"
    # none is a variable argus reads for something else
    others = {"ARGUS_CONFIG", "ARGUS_REDIS_PASSWORD", "ARGUS_REDIS_PASSWORD_FILE", "ARGUS_DEBUG"}
    assert not others & set(names)
    assert "ARGUS_VERSION" not in names  # --version is eager: a variable must not print it
    assert EXIT_CODES["ConfigError"] == 13 and len(set(EXIT_CODES.values())) == len(EXIT_CODES)


def test_main_prints_the_error_and_exits_13(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "argus.toml"
    f.write_text("[top]\ncolour = true\n")
    assert main(["--config", str(f), "alerts", "--job", "x"]) == 13
    err = capsys.readouterr().err
    assert err.startswith(f"ERROR: {f}: [top] colour is not an option of `argus top`\nHINT: its options: ")
    assert "Traceback" not in err


@pytest.mark.redis
def test_flags_beat_variables_beat_the_file(tmp_path: Path, redis_url: str) -> None:
    """`argus alerts` as a process: the file's Redis is used; a variable wins over it; a flag wins
    over both. Two ends that refuse connections tell which one was used."""
    closed = "redis://127.0.0.1:1/0"
    f = tmp_path / "argus.toml"
    f.write_text(f'[redis]\nurl = "{redis_url}"\n')
    env = {"ARGUS_CONFIG": str(f)}
    assert run_argus("alerts", "--job", "x", env=env).returncode == 0
    res = run_argus("alerts", "--job", "x", env={**env, "ARGUS_ALERTS_REDIS": closed})
    assert res.returncode == 8 and "127.0.0.1:1/0" in res.stderr, res.stderr
    res = run_argus("alerts", "--job", "x", "--redis", redis_url, env={**env, "ARGUS_ALERTS_REDIS": closed})
    assert res.returncode == 0, res.stderr
    # --config names the file too; ARGUS_CONFIG= (empty) reads none, so --redis is missing again
    assert run_argus("--config", str(f), "alerts", "--job", "x").returncode == 0
    res = run_argus("alerts", "--job", "x", env={"ARGUS_CONFIG": ""})
    assert res.returncode == 2 and "--redis" in res.stderr, res.stderr
    res = run_argus("--config", str(f), "doctor", "--json")
    row = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "config")
    assert row["status"] == "OK" and row["detail"].startswith(str(f)), row


@pytest.mark.redis
def test_the_files_credentials_log_in(tmp_path: Path) -> None:
    """A Redis with a password: the file names the password's file, never the password."""
    from tests.redisproc import RedisProc

    srv = RedisProc(tmp_path / "redis").start()
    try:
        redis.Redis(port=srv.port).config_set("requirepass", "pw-of-the-test")
        pw = tmp_path / "agent.pw"
        pw.write_text("pw-of-the-test\n")
        os.chmod(pw, stat.S_IRUSR | stat.S_IWUSR)
        f = tmp_path / "argus.toml"
        f.write_text(f'[redis]\nurl = "{srv.url}"\n')
        res = run_argus("--config", str(f), "alerts", "--job", "x")
        assert res.returncode == 8 and "Traceback" not in res.stderr, res.stderr  # no password: refused
        f.write_text(f'[redis]\nurl = "{srv.url}"\npassword_file = "{pw}"\n')
        res = run_argus("--config", str(f), "alerts", "--job", "x")
        assert res.returncode == 0, res.stderr
    finally:
        srv.stop()


def test_the_shipped_example_and_the_documented_one_load() -> None:
    """deploy/argus.toml and the ```toml block of docs/config.md, read by the real loader."""
    root = Path(__file__).resolve().parents[1]
    cfg = conffile.load(cli, str(root / "deploy" / "argus.toml"), {})
    assert cfg.default_map["probe"]["redis_url"].startswith("redis://") and cfg.env["ARGUS_REDIS_USERNAME"]
    doc = (root / "docs" / "config.md").read_text()
    block = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as t:
        t.write(block)
        t.flush()
        cfg = conffile.load(cli, t.name, {})
    assert cfg.default_map["probe"]["launch_latency"] is False and cfg.default_map["sim"]["run"]["ranks"] == 4


def test_no_variable_of_the_deploy_recipes_is_taken_for_an_option() -> None:
    """Every option reads ARGUS_<COMMAND>_<OPTION> now: the recipes' own variables (argus.env's
    ARGUS_PROBE_ARGS, the Slurm scripts' ARGUS_SLURM_MATCH, ...) must not be one of them."""
    import re

    root = Path(__file__).resolve().parents[1]
    options = {p.envvar for _k, c in conffile._commands(cli) for p in c.params if isinstance(p.envvar, str)}
    used = set()
    for f in [*root.joinpath("deploy").rglob("*"), root / "scripts" / "setup.sh"]:
        if f.is_file() and f.suffix in ("", ".env", ".sh", ".service", ".yaml", ".py", ".md"):
            used |= set(re.findall(r"\bARGUS_[A-Z0-9_]+", f.read_text(errors="replace")))
    assert used and not used & options, used & options
