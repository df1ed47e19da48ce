"""A PUT's body read by the transport straight into the upload's aligned buffers.

Through ASGI each byte is copied four times before the agent sees it (the event loop's read
into a new ``bytes``, the HTTP parser's body slice, uvicorn's ``bytearray`` and the ``bytes`` of
each message) and every read costs a message, an event and a pause/resume of reading
(bench/RESULTS.md). ``UploadHttpProtocol`` is uvicorn's httptools protocol that, for a PUT with
a Content-Length, offers the app a ``RawBody`` in ``scope["extensions"]``. Once the app starts
it, the connection's transport is switched to a ``BufferedProtocol`` whose ``get_buffer`` is the
upload's ring (``agent._pipe``): the kernel copies each byte once, into the buffer that sha256
and O_DIRECT then read. It never reads past the body, so after the last byte the connection goes
back to HTTP with a fresh parser and keep-alive works as before.

An app that never starts it reads the body through ``receive`` as usual (any server, any test
transport). Tied to uvicorn's httptools protocol (its ``cycle``, ``parser``, ``flow``); the tests
in ``tests/agent/test_raw_body.py`` run it over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import httptools
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lorafleet.agent._pipe import Pipe, WriteFailed

__all__ = ["RAW_BODY", "RawBody", "UploadHttpProtocol", "upload_http_protocol"]

RAW_BODY = "lorafleet.raw_body"
"""The key of a ``RawBody`` in ``scope["extensions"]``."""
TESTED_UVICORN = ((0, 29), (0, 56))
"""The uvicorn versions (from, to excluded) whose httptools protocol internals this relies on."""


def upload_http_protocol() -> type[HttpToolsProtocol] | None:
    """``UploadHttpProtocol`` where uvicorn is a tested version; None (uvicorn's own protocol,
    bodies through ASGI) otherwise: a newer uvicorn costs speed, never correctness."""
    import uvicorn

    try:
        version = tuple(int(x) for x in uvicorn.__version__.split(".")[:2])
    except ValueError:
        return None
    low, high = TESTED_UVICORN
    return UploadHttpProtocol if low <= version < high else None


class UploadHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, offering a ``RawBody`` for each PUT with a Content-Length."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope or self.scope.get("method") != "PUT":
            return
        length = None
        for name, value in self.headers:
            if name == b"transfer-encoding":
                return  # chunked framing: the parser's job
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return
                length = int(value)
        if length:
            self.scope.setdefault("extensions", {})[RAW_BODY] = RawBody(self, cycle, length)


class RawBody:
    """The body of one PUT, for ``read_into`` (once, before anything called ``receive``)."""

    def __init__(self, proto: UploadHttpProtocol, cycle: Any, length: int) -> None:
        self.proto = proto
        self.cycle = cycle
        self.length = length
        self.received = 0

    def usable(self) -> bool:
        """False when the connection is not in a state to switch (pipelined, gone, read)."""
        p, c = self.proto, self.cycle
        try:
            return (
                p.cycle is c
                and not p.pipeline
                and p.parser is not None
                and not c.disconnected
                and not c.response_complete
                and self.received == 0
            )
        except AttributeError:  # a uvicorn whose internals moved: the ASGI body instead
            return False

    async def read_into(
        self,
        pipe: Pipe,
        stall_s: float | None = None,
        tick: Callable[[], None] | None = None,
    ) -> int:
        """Receive the whole body into ``pipe``; return its length. Raises ``ClientDisconnect``
        if the connection ends first, ``TimeoutError`` after ``stall_s`` without a byte, and
        ``WriteFailed`` as soon as the pipe cannot write. ``tick``: called about every second
        while bytes arrive (the session's last activity)."""
        c = self.cycle
        if c.waiting_for_100_continue and not c.transport.is_closing():
            c.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            c.waiting_for_100_continue = False
        transport = c.transport
        if c.more_body:
            # Nothing may reach the old parser while what it took is fed: bytes it took then
            # would land after the head in its buffer, which nobody reads again.
            transport.pause_reading()
        if c.body:  # what the parser took before the app started: copied once
            head = bytes(c.body)
            c.body = bytearray()
            self.received += len(head)
            try:
                await pipe.feed(head)
            except BaseException:
                transport.resume_reading()
                raise
        if not c.more_body:
            return self.received  # the parser already had all of it
        reader = _Reader(self, pipe)
        transport.set_protocol(reader)
        self.proto.flow.resume_reading()  # uvicorn pauses at 64 KiB buffered
        transport.resume_reading()  # and so did this method, above
        try:
            seen = self.received
            while not reader.done.done():
                try:
                    await asyncio.wait_for(asyncio.shield(reader.done), stall_s or 1.0)
                except TimeoutError:
                    if stall_s is not None and self.received == seen:
                        raise
                    seen = self.received
                    if tick is not None:
                        tick()
            reader.done.result()
        except BaseException:
            reader.abort()
            raise
        return self.received


class _Reader(asyncio.BufferedProtocol):
    """The transport's protocol while a body streams into a pipe."""

    def __init__(self, body: RawBody, pipe: Pipe) -> None:
        self.body = body
        self.pipe = pipe
        self.proto = body.proto
        self.transport = body.cycle.transport
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.paused = False
        self.discard: bytearray | None = None
        pipe.on_space = self._space

    def get_buffer(self, sizehint: int) -> memoryview:
        left = self.body.length - self.body.received
        if self.discard is not None:
            return memoryview(self.discard)[: min(left, len(self.discard))]
        view = self.pipe.view(grow=True)  # reading pauses before the ring runs out
        assert view is not None
        return view[:left]

    def buffer_updated(self, nbytes: int) -> None:
        self.body.received += nbytes
        if self.discard is None:
            self.pipe.advance(nbytes)
            if self.pipe.error is not None:
                self._end(WriteFailed())
                return
        if self.body.received == self.body.length:
            self._back()
            self._end(None)
        elif self.discard is None and self.pipe.view() is None:
            self.paused = True  # every buffer is in flight: let TCP push back on the sender
            self.transport.pause_reading()

    def _space(self) -> None:
        if self.paused and not self.done.done():
            self.paused = False
            self.transport.resume_reading()

    def _back(self) -> None:
        """The body is complete: the connection speaks HTTP again, from a fresh parser."""
        p, c = self.proto, self.body.cycle
        self.pipe.on_space = None
        parser = httptools.HttpRequestParser(p)
        with contextlib.suppress(AttributeError):
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        p.parser = parser
        c.more_body = False
        c.message_event.set()  # a later receive() sees the end of the body, not a hang
        self.transport.set_protocol(p)
        if self.paused:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """The app stopped reading: drop the rest of the body, then the connection."""
        self.pipe.on_space = None
        if self.transport.get_protocol() is self:
            self.discard = bytearray(1 << 16)
            self.body.cycle.keep_alive = False  # closed once the answer is sent
            if self.paused:
                self.paused = False
                self.transport.resume_reading()

    def _end(self, exc: BaseException | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

    def eof_received(self) -> bool | None:
        return self.proto.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe.on_space = None
        self.proto.connection_lost(exc)
        self._end(ClientDisconnect())

    def pause_writing(self) -> None:
        self.proto.pause_writing()

    def resume_writing(self) -> None:
        self.proto.resume_writing()
