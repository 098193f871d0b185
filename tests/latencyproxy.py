"""A TCP proxy that delays every byte by a fixed time each way: a slow network link for tests on a
kernel without `sch_netem` (this machine's has none, so `tc qdisc ... netem` is not an option).

    with LatencyProxy(("127.0.0.1", redis_port), delay_s=0.05) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"     # 100 ms round trips

Order is kept per direction; a chunk is written `delay_s` after it was read (bandwidth is not
limited). Runs an asyncio loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import List, Optional, Tuple


class LatencyProxy:
    def __init__(self, upstream: Tuple[str, int], delay_s: float) -> None:
        self.upstream, self.delay_s = upstream, delay_s
        self.port = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: Optional[asyncio.base_events.Server] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)
        self._writers: List[asyncio.StreamWriter] = []

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        assert self._ready.wait(10), "the latency proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._shutdown)
        self._thread.join(10)

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
        self._loop.stop()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_w]
        await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer), return_exceptions=True)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[Tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()
            dst.close()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await src.read(65536)
                await queue.put((time.monotonic() + self.delay_s, data))
                if not data:
                    break
        finally:
            await task
