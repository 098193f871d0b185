"""A file-based key/value rendezvous store (the role torchrun's TCPStore plays): rank 0 of a
group publishes its NCCL unique id, the others wait for it."""

from __future__ import annotations

import os
import time
from pathlib import Path


class FileStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def set(self, key: str, value: bytes) -> None:
        tmp = self.root / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(value)
        os.replace(tmp, self.root / key)

    def get(self, key: str, timeout: float = 120.0) -> bytes:
        path = self.root / key
        deadline = time.monotonic() + timeout
        while True:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"store key '{key}' did not appear within {timeout:.0f} s") from None
                time.sleep(0.005)
