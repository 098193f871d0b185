"""Where Redis is and how to log in: a URL for the place, the environment for the secret.

``redis://[USER@]HOST[:PORT][/DB]``, ``rediss://...`` (TLS) or ``unix:///path/redis.sock[?db=N]``.
The password never comes from the command line (argv is readable by every user through
/proc/PID/cmdline and ends up in shell histories and logs): it comes from ``ARGUS_REDIS_PASSWORD``
or from the file named by ``ARGUS_REDIS_PASSWORD_FILE``; the ACL user from the URL or
``ARGUS_REDIS_USERNAME``. A URL with a password is refused. TLS options are URL query parameters:
``ca=FILE`` (CA bundle), ``cert=FILE`` and ``key=FILE`` (client certificate), ``verify=no``
(skip certificate checks; for tests only).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional
from urllib.parse import parse_qsl, unquote, urlsplit

from argus.errors import UsageError

ENV_USER = "ARGUS_REDIS_USERNAME"
ENV_PASSWORD = "ARGUS_REDIS_PASSWORD"
ENV_PASSWORD_FILE = "ARGUS_REDIS_PASSWORD_FILE"
_TLS_PARAMS = {"ca", "cert", "key", "verify"}
_HINT = "e.g. redis://127.0.0.1:6379/0, rediss://redis.example:6380/0 or unix:///run/redis.sock"


@dataclass(frozen=True)
class RedisConf:
    scheme: str  # redis | rediss | unix
    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    path: str = ""  # unix socket
    username: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False, compare=False)
    tls: Dict[str, str] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list, compare=False)

    @property
    def display(self) -> str:
        """The URL without any secret (safe for logs and the live table)."""
        user = f"{self.username}@" if self.username else ""
        if self.scheme == "unix":
            return f"unix://{user}{self.path}?db={self.db}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{user}{host}:{self.port}/{self.db}"

    def __str__(self) -> str:
        return self.display

    def client_kwargs(self, timeout_s: float = 2.0) -> Dict[str, Any]:
        kw: Dict[str, Any] = {
            "db": self.db,
            "username": self.username,
            "password": self.password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "decode_responses": False,
            "health_check_interval": 0,
        }
        if self.scheme == "unix":
            kw["unix_socket_path"] = self.path
        else:
            kw.update(host=self.host, port=self.port, socket_keepalive=True)
        if self.scheme == "rediss":
            kw["ssl"] = True
            kw["ssl_cert_reqs"] = "none" if self.tls.get("verify") == "no" else "required"
            if "ca" in self.tls:
                kw["ssl_ca_certs"] = self.tls["ca"]
            if "cert" in self.tls:
                kw["ssl_certfile"] = self.tls["cert"]
            if "key" in self.tls:
                kw["ssl_keyfile"] = self.tls["key"]
        return kw

    def client(self, timeout_s: float = 2.0) -> Any:
        """A redis-py client (connects lazily, on the first command)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no hidden retries inside redis-py (v6+ retries 3 times with backoff by default): callers
        # decide (the publisher reconnects with its own backoff and never waits on Redis)
        return redis.Redis(retry=Retry(NoBackoff(), 0), **self.client_kwargs(timeout_s))


RUNNING_HINT = "is redis-server running? check --redis"


def connection_hint(err: BaseException, scheme: Optional[str] = None, default: str = RUNNING_HINT) -> str:
    """What to do about a failed connection, from redis-py's error: TLS problems (a CA that did not
    sign the server's certificate, TLS on one side only) get their own fix, the rest `default`."""
    text = str(err).lower()
    if "certificate verify failed" in text:
        if "hostname mismatch" in text or "ip address mismatch" in text:
            return "the server's certificate is for another name: connect by a name (or IP) it lists"
        return (
            "the server's certificate is not signed by the CA given: pass the CA that signed it, "
            "rediss://HOST:PORT/DB?ca=/path/ca.pem (without ca= the system's CAs are used)"
        )
    if "certificate required" in text or "tlsv13 alert" in text or "handshake failure" in text:
        return "the server wants a client certificate: add &cert=/path/client.pem&key=/path/client.key"
    if "wrong version number" in text or "record layer failure" in text or "unknown protocol" in text:
        return "the server does not speak TLS on this port: use redis://, or the port of its --tls-port"
    if scheme == "rediss" and "timeout" in text:
        return "; ".join(
            filter(None, ["no TLS handshake: if the server does not speak TLS here, use redis://", default])
        )
    if scheme in ("redis", None) and ("reset by peer" in text or "closed by server" in text):
        return "; ".join(
            filter(
                None, ["if the server speaks TLS on this port, use rediss://HOST:PORT/DB?ca=FILE", default]
            )
        )
    return default


def _password(env: Mapping[str, str], warnings: List[str]) -> Optional[str]:
    path = env.get(ENV_PASSWORD_FILE)
    if path:
        try:
            st = os.stat(path)
            with open(path, encoding="utf-8") as f:
                secret = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(
                f"cannot read {ENV_PASSWORD_FILE}={path}: {type(e).__name__}",
                "point it at a readable file holding only the password (chmod 600)",
            ) from None
        # group access is fine when the group is this process's own (a Kubernetes Secret mounted
        # for a non-root pod is readable through its fsGroup, mode 0440, and no other way)
        own_group = st.st_gid == os.getegid() or st.st_gid in os.getgroups()
        if st.st_mode & stat.S_IRWXO or (st.st_mode & stat.S_IRWXG and not own_group):
            warnings.append(f"{path} is readable by other users: chmod 600 {path}")
        return secret
    pw = env.get(ENV_PASSWORD)
    return pw if pw else None


def parse(url: str, env: Optional[Mapping[str, str]] = None) -> RedisConf:
    """Parse a Redis URL plus the credentials in `env` (default: os.environ). Raises UsageError."""
    env = os.environ if env is None else env
    try:
        u = urlsplit(url.strip())
        port = u.port
    except ValueError:
        raise UsageError("--redis: not a valid URL (bad port or brackets)", _HINT) from None
    scheme = u.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise UsageError(f"--redis: unsupported scheme '{u.scheme or '(none)'}'", _HINT)
    if u.password is not None:
        raise UsageError(
            "--redis: the URL contains a password; it would be visible to every user in the process list",
            f"drop it from the URL and export {ENV_PASSWORD} or {ENV_PASSWORD_FILE}=/path/to/file",
        )
    query = dict(parse_qsl(u.query, keep_blank_values=True))
    warnings: List[str] = []
    username = unquote(u.username) if u.username else None
    username = env.get(ENV_USER) or username
    db = 0
    if scheme == "unix":
        if not u.path:
            raise UsageError("--redis: unix:// needs a socket path", "e.g. unix:///run/redis/redis.sock?db=0")
        db_txt = query.pop("db", "0")
    else:
        if not u.hostname:
            raise UsageError("--redis: no host in the URL", _HINT)
        db_txt = u.path.lstrip("/") or "0"
    try:
        db = int(db_txt)
        if db < 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--redis: database '{db_txt}' is not a non-negative integer", _HINT) from None
    tls = {k: v for k, v in query.items() if k in _TLS_PARAMS}
    unknown = set(query) - _TLS_PARAMS
    if unknown:
        raise UsageError(
            f"--redis: unknown URL parameter(s) {', '.join(sorted(unknown))}",
            "known: ca=FILE, cert=FILE, key=FILE, verify=no (rediss:// only)",
        )
    if tls and scheme != "rediss":
        raise UsageError("--redis: TLS parameters need rediss://", "use rediss://HOST:PORT/DB?ca=FILE")
    if tls.get("verify", "yes") not in ("yes", "no"):
        raise UsageError("--redis: verify= takes yes or no", "verify=no skips certificate checks")
    for k in ("ca", "cert", "key"):  # a missing file is the user's typo, not an unreachable Redis
        if k in tls and not os.access(tls[k], os.R_OK):
            raise UsageError(
                f"--redis: {k}={tls[k]} is not a readable file",
                f"give the path of the PEM file ({'CA bundle' if k == 'ca' else 'client ' + k})",
            )
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"--redis: port {port} out of range", _HINT)
    return RedisConf(
        scheme=scheme,
        host=u.hostname or "",
        port=port or 6379,
        db=db,
        path=u.path if scheme == "unix" else "",
        username=username,
        password=_password(env, warnings),
        tls=tls,
        warnings=warnings,
    )
