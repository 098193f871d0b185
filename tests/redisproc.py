"""A redis-server a test owns: fixed port, killed and restarted on the same port at will."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, List, Optional


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProc:
    """`durable=True`: append-only file with fsync on every write, so whatever Redis acknowledged
    survives a SIGKILL (the restarted server reloads it)."""

    def __init__(self, workdir: Path, port: Optional[int] = None, durable: bool = False, *extra: str) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None, "no redis-server"
        self.exe, self.dir, self.port = exe, workdir, port or free_port()
        self.durable, self.extra = durable, extra
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cmd(self) -> List[str]:
        c = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir)]
        c += ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        return c + list(self.extra)

    def admin(self, timeout: float = 2.0) -> Any:
        """A client of this server (subclasses that speak TLS override it)."""
        import redis

        return redis.Redis(port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def start(self, timeout: float = 10.0) -> RedisProc:
        import redis

        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(self.cmd(), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        client = self.admin(timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, (self.dir / "redis.log").read_text()[-2000:]
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.kill()  # never leave a server behind that the caller will not stop (it never got it)
        raise AssertionError(f"redis-server on {self.port} did not answer")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too and below 65536."""
    import random

    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise AssertionError("no free port pair for a cluster node")


class RedisClusterProcs:
    """A Redis Cluster of `masters` redis-servers on loopback ports (no replicas), made with
    `redis-cli --cluster create` as an operator would; `url` names two of them as seeds, so the
    client must learn the third from them."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = [
            RedisProc(
                workdir / f"node-{i}",
                free_cluster_port(),
                False,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def start(self, timeout: float = 30.0) -> RedisClusterProcs:
        try:
            for n in self.nodes:
                n.start()
            cli = shutil.which("redis-cli")
            assert cli is not None, "no redis-cli"
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            res = subprocess.run(
                [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert res.returncode == 0, res.stdout + res.stderr
            deadline = time.monotonic() + timeout
            while not all(self._ok(n) for n in self.nodes):
                assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
                time.sleep(0.1)
            return self
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ok(n: RedisProc) -> bool:
        c = n.admin()
        try:
            return b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
        finally:
            c.close()

    def master_of(self, key: str) -> int:
        """The port of the master that holds `key`."""
        c = self.nodes[0].admin()
        try:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return int(master[1])
        finally:
            c.close()
        raise AssertionError(f"no master holds slot {slot}")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
