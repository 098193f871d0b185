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
