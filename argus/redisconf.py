"""Where Redis is and how to log in: a URL for the place, the environment for the secret.

``redis://[USER@]HOST[:PORT][/DB]``, ``rediss://...`` (TLS), ``unix:///path/redis.sock[?db=N]``, or
a Redis Cluster: ``redis+cluster://[USER@]HOST:PORT[,HOST:PORT...]`` (``rediss+cluster://`` with TLS),
its seed nodes; the client learns the rest of the cluster from them. Every key of one job carries
the job as its hash tag (``argus:{JOB}:...``, argus/transport.py), so a job's streams, registry and
alerts live on one master and its multi-key commands never cross slots; jobs spread over masters.
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
from typing import Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

from argus.errors import UsageError

ENV_USER = "ARGUS_REDIS_USERNAME"
ENV_PASSWORD = "ARGUS_REDIS_PASSWORD"
ENV_PASSWORD_FILE = "ARGUS_REDIS_PASSWORD_FILE"
_TLS_PARAMS = {"ca", "cert", "key", "verify"}
_HINT = "e.g. redis://127.0.0.1:6379/0, rediss://redis.example:6380/0 or unix:///run/redis.sock"


@dataclass(frozen=True)
class RedisConf:
    scheme: str  # redis | rediss | unix | redis+cluster | rediss+cluster
    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    path: str = ""  # unix socket
    username: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False, compare=False)
    tls: Dict[str, str] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list, compare=False)
    seeds: Tuple[Tuple[str, int], ...] = ()  # a cluster's seed nodes (host, port); empty: one server

    @property
    def cluster(self) -> bool:
        return bool(self.seeds)

    @property
    def tls_scheme(self) -> bool:
        return self.scheme in ("rediss", "rediss+cluster")

    @property
    def display(self) -> str:
        """The URL without any secret (safe for logs and the live table)."""
        user = f"{self.username}@" if self.username else ""
        if self.cluster:
            return f"{self.scheme}://{user}" + ",".join(_hostport(h, p) for h, p in self.seeds)
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
        if self.tls_scheme:
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

        if self.cluster:
            return ClusterClient(self, timeout_s)
        # no hidden retries inside redis-py (v6+ retries 3 times with backoff by default): callers
        # decide (the publisher reconnects with its own backoff and never waits on Redis)
        return redis.Redis(retry=Retry(NoBackoff(), 0), **self.client_kwargs(timeout_s))


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_cluster(client: Any) -> bool:
    """Whether `client` talks to a Redis Cluster (whose pipelines refuse PUBLISH)."""
    if isinstance(client, ClusterClient):
        return True
    try:
        from redis.cluster import RedisCluster
    except ImportError:  # pragma: no cover - redis-py always has it (>= 4.1)
        return False
    return isinstance(client, RedisCluster)


class ClusterClient:
    """A redis-py RedisCluster that connects on its first command, as redis.Redis does: RedisCluster
    asks a seed for the slot map when it is made, and raises its own exception type when none
    answers, which every caller would otherwise need to know. Here an unreachable cluster is a
    redis.ConnectionError at the first command, as for one server."""

    def __init__(self, conf: RedisConf, timeout_s: float) -> None:
        self._conf, self._timeout_s = conf, timeout_s
        self._c: Any = None

    def _connect(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.exceptions import RedisClusterException
        from redis.retry import Retry

        kw = self._conf.client_kwargs(self._timeout_s)
        for k in ("db", "host", "port", "socket_keepalive"):
            kw.pop(k, None)
        try:
            # one retry without waiting: enough to follow a slot that moved (MOVED, a failover), while
            # the publisher's own backoff decides about a cluster that is down
            return RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self._conf.seeds],
                retry=Retry(NoBackoff(), 1),
                **kw,
            )
        except RedisClusterException as e:
            raise redis.ConnectionError(f"no seed node of the cluster answered ({e})") from e

    def close(self) -> None:
        if self._c is not None:
            self._c.close()

    def __getattr__(self, name: str) -> Any:
        if self._c is None:
            self._c = self._connect()
        return getattr(self._c, name)


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
    if scheme in ("rediss", "rediss+cluster") and "timeout" in text:
        return "; ".join(
            filter(None, ["no TLS handshake: if the server does not speak TLS here, use redis://", default])
        )
    if scheme in ("redis", "redis+cluster", None) and ("reset by peer" in text or "closed by server" in text):
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
    head = url.strip().split("://", 1)[0].lower()
    if head in ("redis+cluster", "rediss+cluster"):
        return _parse_cluster(url.strip(), head, env)
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


_CLUSTER_HINT = "e.g. redis+cluster://10.0.0.5:7000,10.0.0.6:7000 (seed nodes; the rest is learned from them)"


def _parse_cluster(url: str, scheme: str, env: Mapping[str, str]) -> RedisConf:
    """redis+cluster://[USER@]HOST:PORT[,HOST:PORT...][/0][?TLS params]: urlsplit cannot take a list
    of hosts, so the seed list is split here and each seed parsed as a URL of its own."""
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query_txt = tail.partition("?")
    if "?" in netloc:
        netloc, _, query_txt = netloc.partition("?")
    user_txt, at, hosts = netloc.rpartition("@")
    if at and ":" in user_txt:
        raise UsageError(
            "--redis: the URL contains a password; it would be visible to every user in the process list",
            f"drop it from the URL and export {ENV_PASSWORD} or {ENV_PASSWORD_FILE}=/path/to/file",
        )
    seeds: List[Tuple[str, int]] = []
    for part in filter(None, (p.strip() for p in hosts.split(","))):
        try:
            u = urlsplit(f"redis://{part}")
            port = u.port
        except ValueError:
            raise UsageError(f"--redis: seed node '{part}' is not HOST:PORT", _CLUSTER_HINT) from None
        if not u.hostname or u.path or u.query:
            raise UsageError(f"--redis: seed node '{part}' is not HOST:PORT", _CLUSTER_HINT)
        if port is not None and not 0 < port < 65536:
            raise UsageError(f"--redis: port {port} out of range", _CLUSTER_HINT)
        seeds.append((u.hostname, port or 6379))
    if not seeds:
        raise UsageError("--redis: a cluster URL needs at least one seed node", _CLUSTER_HINT)
    if path.strip("/") not in ("", "0"):
        raise UsageError(
            f"--redis: database '{path.strip('/')}' in a cluster URL: a Redis Cluster has only database 0",
            _CLUSTER_HINT,
        )
    # the TLS parameters and their checks are those of one server: parse a stand-in URL for them
    one = parse(
        f"{scheme.split('+')[0]}://{seeds[0][0] if ':' not in seeds[0][0] else '[' + seeds[0][0] + ']'}"
        f":{seeds[0][1]}/0" + (f"?{query_txt}" if query_txt else ""),
        env,
    )
    username = env.get(ENV_USER) or (unquote(user_txt) if at else None)
    return RedisConf(
        scheme=scheme,
        host=seeds[0][0],
        port=seeds[0][1],
        db=0,
        username=username,
        password=one.password,
        tls=one.tls,
        warnings=one.warnings,
        seeds=tuple(seeds),
    )
