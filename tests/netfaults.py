"""A TCP proxy on loopback that puts faults on one link: a rate limit, one flipped byte in an
upload body, and a callback once so many upload bytes have passed (to kill a peer mid-stream).

It runs its own event loop in a thread, so synchronous tests can use it around real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

_PUT = b"PUT /v1/uploads/"
_HEAD_END = b"\r\n\r\n"


class FaultyLink:
    """``FaultyLink(port)`` listens on 127.0.0.1 (``.url``) and forwards to 127.0.0.1:port.

    ``rate``: bytes/s towards the server (None: unlimited). ``flip_at``: flip one bit of the
    byte at this offset of the first upload PUT body that reaches it. ``after_body(n, fn)``:
    call ``fn`` (once, on the proxy's thread) when n upload body bytes have passed.
    """

    def __init__(
        self,
        port: int,
        *,
        rate: float | None = None,
        flip_at: int | None = None,
        after_body: tuple[int, Callable[[], None]] | None = None,
    ) -> None:
        self.target = port
        self.rate = rate
        self.flip_at = flip_at
        self.after_body = after_body
        self.body_bytes = 0
        self.flipped = False
        self._fired = False
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True, name="faulty-link")
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        def stop() -> None:
            self._server.close()
            for t in asyncio.all_tasks(self._loop):
                t.cancel()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)

    def __enter__(self) -> FaultyLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            cw.close()
            return
        up = asyncio.create_task(self._upstream(cr, sw))
        down = asyncio.create_task(self._pipe(sr, cw))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (sw, cw):
            with contextlib.suppress(Exception):
                w.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(1 << 16):
            w.write(data)
            await w.drain()

    async def _upstream(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        """Client to server: find upload bodies (a PUT's Content-Length bytes after its head)
        and fault them; everything else passes as it came."""
        buf = b""  # bytes not yet classified (a head may be split across reads)
        left = 0  # body bytes of the current upload PUT still to come
        while data := await r.read(1 << 16):
            out = bytearray()
            buf += data
            while buf:
                if left:
                    n = min(left, len(buf))
                    out += self._fault(bytearray(buf[:n]))
                    buf, left = buf[n:], left - n
                    continue
                end = buf.find(_HEAD_END)
                if end < 0:
                    break  # wait for the rest of the head
                head, buf = buf[: end + 4], buf[end + 4 :]
                out += head
                if head.startswith(_PUT):
                    for line in head.split(b"\r\n"):
                        k, _, v = line.partition(b":")
                        if k.strip().lower() == b"content-length":
                            left = int(v.strip())
                else:
                    # Not an upload: pass its body through untouched (control bodies are small
                    # and come whole with their head, or in the next read).
                    for line in head.split(b"\r\n"):
                        k, _, v = line.partition(b":")
                        if k.strip().lower() == b"content-length":
                            n = int(v.strip())
                            while len(buf) < n:
                                more = await r.read(1 << 16)
                                if not more:
                                    break
                                buf += more
                            out += buf[:n]
                            buf = buf[n:]
            data = bytes(out)
            if self.rate:
                for k in range(0, len(data), 16384):
                    w.write(data[k : k + 16384])
                    await w.drain()
                    await asyncio.sleep(min(16384, len(data) - k) / self.rate)
            else:
                w.write(data)
                await w.drain()

    def _fault(self, body: bytearray) -> bytes:
        start = self.body_bytes
        self.body_bytes += len(body)
        at = self.flip_at
        if at is not None and not self.flipped and start <= at < self.body_bytes:
            body[at - start] ^= 0x01
            self.flipped = True
        if self.after_body and not self._fired and self.body_bytes >= self.after_body[0]:
            self._fired = True
            self.after_body[1]()
        return bytes(body)
