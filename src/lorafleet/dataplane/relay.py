"""Relaying an engine's OpenAI-shaped answer to the client: whole, or as a server-sent stream.

A whole 200 JSON answer is tagged by splicing bytes; an error is relayed with engine-side names
scrubbed. A stream goes out event by event (only whole events: a stream that breaks off mid-event
never leaves the client half an event), the tag event just before the engine's ``data: [DONE]``.
A stream that fails after its first byte (the engine broke off, ended without ``[DONE]``, or sent
an error event) ends with an error event and ``data: [DONE]``, never with a version tag.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp

from lorafleet._service import send_error
from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.tagging import (
    DONE,
    MODEL_RE,
    broke_off,
    error_event,
    esc,
    scrub,
    splice_tag,
    tag_event,
    tag_headers,
)
from lorafleet.errors import EngineRejected, StreamInterrupted

__all__ = ["relay_stream", "relay_whole", "send_whole", "watched"]

# The end-of-stream event starts a line; model text inside a JSON payload never contains a raw
# newline, so "\ndata: [DONE]" cannot be matched inside an event's content.
_DONE_LINE = b"\n" + DONE
# An error event (vLLM's and SGLang's ``data: {"error": ...}``) at a line start.
_ERROR_LINE = b'\ndata: {"error"'
# An error event is held back until the stream ends, up to this many bytes.
_MAX_ERROR_TAIL = 64 << 10
# An event is held until it is whole, up to this many bytes (then it passes as it comes).
_MAX_EVENT = 1 << 20


async def send_whole(send, status: int, headers: list, body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def relay_whole(
    send,
    route: Route,
    replica: Replica,
    resp: aiohttp.ClientResponse,
    sent_model: str | None,
    transform: Callable[[bytes], bytes] | None = None,
) -> int:
    """Relay a whole answer, tagged if it is a 200 JSON body; the status sent.

    ``transform``: rebuilds a 200 JSON answer in the client's shape first (a ``ValueError`` from
    it is the engine's answer not fitting that shape: 502 ``engine_rejected``)."""
    try:
        body = await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        await send_error(send, StreamInterrupted(broke_off(exc)))
        return 502
    headers = tag_headers(route, replica)
    ctype = resp.headers.get("Content-Type", "application/json")
    if resp.status != 200:
        body = scrub(body, route, sent_model)
    elif ctype.startswith("application/json"):
        if transform is not None:
            try:
                body = transform(body)
            except ValueError as exc:
                await send_error(send, EngineRejected(f"{replica.replica_id}: {exc}"))
                return 502
        body = splice_tag(body, route, replica, sent_model)
    headers.append((b"content-type", ctype.encode()))
    await send_whole(send, resp.status, headers, body)
    return resp.status


async def relay_stream(
    send,
    route: Route,
    replica: Replica,
    resp: aiohttp.ClientResponse,
    path: str,
    sent_model: str | None,
) -> None:
    """Relay an engine's SSE stream with the model renamed, the tag before ``[DONE]``."""
    headers = tag_headers(route, replica)
    headers.append((b"content-type", b"text/event-stream; charset=utf-8"))
    headers.append((b"cache-control", b"no-cache"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    pairs: list[tuple[bytes, bytes]] = []
    if route.engine_name is not None and route.alias is not None and sent_model:
        eng, ali = esc(sent_model), esc(route.alias)
        pairs = [
            (b'"model":"' + eng + b'"', b'"model":"' + ali + b'"'),
            (b'"model": "' + eng + b'"', b'"model": "' + ali + b'"'),
        ]
    engine_model: bytes | None = None
    held = b""  # bytes after the last complete event: not sent yet
    done = False  # the engine's [DONE] was seen, and the tag sent just before it
    failed: bytearray | None = None  # the engine's error event and all after it
    broke: str | None = None

    async def out(data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    try:
        async for chunk in resp.content.iter_any():
            if done:
                await out(chunk)
                continue
            if failed is not None:
                if len(failed) < _MAX_ERROR_TAIL:
                    failed += chunk
                continue
            buf = held + chunk
            end = _events_end(buf)
            if end == 0 and len(buf) <= _MAX_EVENT:
                held = buf
                continue
            events, held = (buf[:end], buf[end:]) if end else (buf, b"")
            if engine_model is None:
                m = MODEL_RE.search(events)
                if m:
                    engine_model = m.group(1)
            for a, b in pairs:
                events = events.replace(a, b)
            lined = b"\n" + events  # each block starts an event: a line start
            e, i = lined.find(_ERROR_LINE), lined.find(_DONE_LINE)
            if e >= 0 and (i < 0 or e < i):
                events, failed = events[:e], bytearray(events[e:] + held)
                held = b""
            elif i >= 0:
                tagged = tag_event(route, replica, engine_model, path)
                events, done = events[:i] + tagged + events[i:] + held, True
            if events:
                await out(events)
    except (TimeoutError, aiohttp.ClientError) as exc:
        broke = broke_off(exc)
    if not done and failed is None and broke is None:
        # The last event may lack its blank line: the engine's own end or error still count.
        last = held.strip()
        if last == DONE:
            await out(tag_event(route, replica, engine_model, path) + held)
            done = True
        elif last.startswith(_ERROR_LINE[1:]):
            failed = bytearray(held)
    if failed is not None:
        # The engine's own error event, passed on without engine-side names; then the end.
        tail = scrub(bytes(failed), route, sent_model).rstrip(b"\n") + b"\n\n"
        if _DONE_LINE not in b"\n" + tail:
            tail += DONE + b"\n\n"
        await out(tail)
    elif not done:
        await out(error_event(broke or "the engine's stream ended without data: [DONE]"))
    await send({"type": "http.response.body", "body": b""})


async def watched(run: Awaitable[int], receive) -> int:
    """Run ``run``; cancel it if the client disconnects first (status 499 then). Streams can be
    long: the in-flight count stays exact and the engine stops generating."""
    task = asyncio.ensure_future(run)

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # we ourselves are being cancelled
            raise
        return 499


def _events_end(buf: bytes) -> int:
    """Where the last whole SSE event in ``buf`` ends (0: none is whole yet)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
