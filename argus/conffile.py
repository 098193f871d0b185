"""One TOML file for every command: a site writes its Redis address and its flags once.

Where it is: ``argus --config FILE``, else ``$ARGUS_CONFIG``, else ``/etc/argus/argus.toml`` when
it exists (``ARGUS_CONFIG=`` empty: no file). What wins, first to last: the command line, an
environment variable ``ARGUS_<COMMAND>_<OPTION>`` of the option's long name
(``ARGUS_PROBE_INTERVAL=2s``, ``ARGUS_ALERTS_REDIS=redis://...``, ``ARGUS_SIM_RUN_RANKS=4``,
``ARGUS_PROBE_NO_PYTHON=1``: upper case, dashes as underscores), the file, the built-in default.
Everything is checked when it is read, so a typo in the file is one `ERROR:` naming the file and
the key before any command starts, not a flag silently ignored at 3 a.m.

    [redis]                       # every command that takes --redis
    url = "redis://10.0.0.5:6379/0"
    username = "argus-agent"      # as ARGUS_REDIS_USERNAME (the environment wins)
    password_file = "/etc/argus/agent.pw"   # as ARGUS_REDIS_PASSWORD_FILE; never a password here

    [probe]                       # `argus probe`: its long option names, - or _
    all = true
    no-python = true              # a flag: true or false
    launch-steps = "2/60"

    [sim.run]                     # a subcommand of a group
    ranks = 4
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, MutableMapping, Optional, Tuple

import click

from argus.errors import ConfigError

DEFAULT_PATH = "/etc/argus/argus.toml"
ENV_CONFIG = "ARGUS_CONFIG"
ENV_PREFIX = "ARGUS"
# [redis] keys that become environment variables for argus.redisconf (which reads the secret's file)
REDIS_ENV = {"username": "ARGUS_REDIS_USERNAME", "password_file": "ARGUS_REDIS_PASSWORD_FILE"}
MAX_BYTES = 1 << 20
_EXAMPLE = 'e.g. [probe] interval = "2s" or [redis] url = "redis://10.0.0.5:6379/0"'


@dataclass
class Config:
    path: Optional[str]  # None: no file (defaults only)
    default_map: Dict[str, Any] = field(default_factory=dict)  # click's: command -> option -> value
    env: Dict[str, str] = field(default_factory=dict)  # set when not already in the environment


def locate(explicit: Optional[str], environ: Mapping[str, str]) -> Optional[str]:
    """The file to read: the one named (which must exist), else the default path when present."""
    if explicit is not None:
        return explicit or None
    if ENV_CONFIG in environ:
        return environ[ENV_CONFIG] or None
    return DEFAULT_PATH if os.path.isfile(DEFAULT_PATH) else None


def read(path: str) -> Dict[str, Any]:
    """The file's tables; a missing, unreadable, oversized or malformed file is a ConfigError."""
    try:
        import tomllib  # Python 3.11+
    except ImportError as e:  # pragma: no cover - the system interpreter of Debian 12 is 3.11
        raise ConfigError(
            f"{path}: reading a TOML config needs Python 3.11 or newer (this is {_py()})",
            f"unset {ENV_CONFIG} and pass flags instead, or run argus with a newer Python",
        ) from e
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            f"config file {path}: {e.strerror or e}",
            f"give an existing file with --config or {ENV_CONFIG}; {ENV_CONFIG}= (empty) reads none",
        ) from e
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"config file {path} is over {MAX_BYTES} bytes", "it holds flags: a few lines")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}", _EXAMPLE) from e


def _py() -> str:
    import sys

    return ".".join(map(str, sys.version_info[:3]))


Key = Tuple[str, ...]  # a command's path: ("probe",), ("sim", "run")


def _commands(group: click.Group, prefix: Key = ()) -> Iterator[Tuple[Key, click.Command]]:
    for name, cmd in sorted(group.commands.items()):
        yield (*prefix, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))


def _options(cmd: click.Command) -> Dict[str, click.Option]:
    """Its options by the names a file may use: the parameter's name, dashed or not."""
    out: Dict[str, click.Option] = {}
    for p in cmd.params:
        if isinstance(p, click.Option) and p.name and not p.hidden and p.name not in ("help",):
            out[p.name] = p
            out[p.name.replace("_", "-")] = p
            for o in p.opts:  # --run-dir, and a renamed one: --redis for redis_url
                if o.startswith("--"):
                    out[o[2:]] = p
                    out[o[2:].replace("-", "_")] = p
    return out


def _check(cmd: click.Command, opt: click.Option, value: Any, where: str) -> None:
    ctx = click.Context(cmd, info_name=cmd.name)
    hint = f"the value as on the command line: {opt.opts[-1]} VALUE (a list where it repeats)"
    try:
        opt.type_cast_value(ctx, value)
    except click.BadParameter as e:
        raise ConfigError(f"{where} = {value!r}: {e.message}", hint) from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} = {value!r}: {e}", hint) from e


def build(root: click.Group, data: Mapping[str, Any], path: str) -> Config:
    """Check `data` against the commands of `root`; the default_map click reads, and the env."""
    cfg = Config(path)
    cmds = dict(_commands(root))
    redis = data.get("redis", {})
    if not isinstance(redis, dict):
        raise ConfigError(f"{path}: redis must be a table ([redis])", _EXAMPLE)
    for k, v in redis.items():
        if k == "password":
            raise ConfigError(
                f"{path}: [redis] password: a password is never kept in the config file",
                "put it in a root-only file named by [redis] password_file (or ARGUS_REDIS_PASSWORD_FILE)",
            )
        if k not in ("url", *REDIS_ENV) or not isinstance(v, str):
            raise ConfigError(
                f"{path}: [redis] {k} = {v!r} is not a known string key",
                'the keys: url = "redis://HOST:PORT/DB", username = "...", password_file = "/etc/argus/x.pw"',
            )
    if "url" in redis:
        from argus import redisconf

        try:
            redisconf.parse(redis["url"])
        except Exception as e:  # UsageError from redisconf: said again with the file's name
            raise ConfigError(f"{path}: [redis] url: {e}", getattr(e, "hint", "") or _EXAMPLE) from e
    cfg.env = {REDIS_ENV[k]: v for k, v in redis.items() if k in REDIS_ENV}

    def walk(table: Mapping[str, Any], at: Key) -> None:
        for k, v in table.items():
            key = (*at, k)
            name = ".".join(key)
            if key == ("redis",):
                continue
            if key in cmds and isinstance(v, dict):
                cmd = cmds[key]
                if isinstance(cmd, click.Group):
                    walk(v, key)
                else:
                    _command(cmd, key, v)
                continue
            if not at and key not in cmds:
                known = ", ".join(sorted({".".join(p) for p in cmds if not isinstance(cmds[p], click.Group)}))
                raise ConfigError(f"{path}: [{name}] is not an argus command", f"tables: [redis], {known}")
            raise ConfigError(f"{path}: {name} is not a table of options", _EXAMPLE)

    def _command(cmd: click.Command, key: Key, table: Mapping[str, Any]) -> None:
        opts = _options(cmd)
        negations = {
            o[2:].replace("-", sep): p
            for p in cmd.params
            if isinstance(p, click.Option)
            for o in p.secondary_opts
            if o.startswith("--")
            for sep in "-_"
        }
        dm = _slot(cfg.default_map, key)
        for k, v in table.items():
            where = f"{path}: [{'.'.join(key)}] {k}"
            opt = opts.get(k)
            neg = negations.get(k)
            if opt is None and neg is not None and isinstance(v, bool):  # no-launch-latency = true
                opt, v = neg, not v
            if opt is None:
                names = sorted({o[2:] for p in set(opts.values()) for o in p.opts if o.startswith("--")})
                raise ConfigError(
                    f"{where} is not an option of `argus {' '.join(key)}`", f"its options: {', '.join(names)}"
                )
            _check(cmd, opt, v, where)
            assert opt.name is not None
            dm[opt.name] = v

    walk(data, ())
    if "url" in redis:  # every command with --redis, where its own table did not set it
        for key, cmd in cmds.items():
            for p in cmd.params:
                if isinstance(p, click.Option) and "--redis" in p.opts and p.name:
                    _slot(cfg.default_map, key).setdefault(p.name, redis["url"])
    return cfg


def envvar_of(key: Key, opt: click.Option) -> Optional[str]:
    """ARGUS_<COMMAND>_<OPTION> of the option's first long name (click's automatic names follow the
    parameter's name, which differs from the flag where one is renamed: --redis is redis_url)."""
    long = next((o[2:] for o in opt.opts if o.startswith("--")), None)
    if long is None:
        return None
    return "_".join((ENV_PREFIX, *key, long)).replace("-", "_").upper()


def name_envvars(root: click.Group) -> None:
    """Give every option of every command its ARGUS_<COMMAND>_<OPTION> variable."""
    for key, cmd in _commands(root):
        for p in cmd.params:
            if isinstance(p, click.Option) and p.envvar is None and not p.is_eager and not p.hidden:
                p.envvar = envvar_of(key, p)


def _slot(dm: Dict[str, Any], key: Key) -> Dict[str, Any]:
    for k in key:
        dm = dm.setdefault(k, {})
    return dm


def load(root: click.Group, explicit: Optional[str], environ: Mapping[str, str]) -> Config:
    path = locate(explicit, environ)
    if path is None:
        return Config(None)
    return build(root, read(path), path)


def apply_env(cfg: Config, environ: MutableMapping[str, str]) -> List[str]:
    """Set the [redis] credentials' variables the environment does not already have (it wins)."""
    done = []
    for k, v in cfg.env.items():
        if k not in environ:
            environ[k] = v
            done.append(k)
    return done
