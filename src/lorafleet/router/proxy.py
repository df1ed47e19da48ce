"""The data plane's hot path as a bare ASGI handler: resolve, pick, forward, tag.

Why not FastAPI here: routing, dependency injection and response classes cost tens of
microseconds per request, and this path has a latency budget of a few hundred. The handler reads
the body, resolves ``model`` against the alias table **at arrival**, counts the request in flight
(no ``await`` between the two, see balancer.py), forwards it over a pooled aiohttp session and
streams the answer back chunk by chunk. JSON bodies are tagged by splicing bytes, not re-encoding.

What ``model`` names is decided in ``router/addressing.py``; lorafleet's own ``/generate``
shape is translated in ``router/token_generate.py``, SGLang's (a body with ``text`` or
``input_ids``) answered by ``router/native.py``.

A client never sees an engine-side name in an error (``policy@v3`` becomes ``policy``), and a
stream that fails after its first byte (the engine broke off, ended without ``[DONE]``, or sent
an error event) ends with an error event and ``data: [DONE]``, never with a version tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import re
import time

import aiohttp

from lorafleet._service import check_token, send_error
from lorafleet.engine_kinds import address, engine_kind, model_field
from lorafleet.errors import (
    BodyTooLarge,
    EngineRejected,
    EngineUnavailable,
    Forbidden,
    InvalidName,
    InvalidRequest,
    NoReplica,
    NotFound,
    ServiceError,
    StaleVersion,
    StreamInterrupted,
    Unauthorized,
    VersionNotRoutable,
)
from lorafleet.protocol.errors import error_body
from lorafleet.protocol.router import (
    ADAPTER_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
    TAG_FIELD,
    VERSION_HEADER,
)
from lorafleet.protocol.sglang import is_native_generate
from lorafleet.router import inference_generate as inference
from lorafleet.router import token_generate
from lorafleet.router.addressing import Addressing, Route
from lorafleet.router.balancer import Balancer, Replica
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.native import Native
from lorafleet.router.table import AliasStore

__all__ = ["DATA_PLANE_ERRORS", "MAX_BODY", "Proxy"]

MAX_BODY = 32 << 20
DATA_PLANE_ERRORS: tuple[type[ServiceError], ...] = (
    InvalidRequest,
    InvalidName,
    Unauthorized,
    Forbidden,
    NotFound,
    VersionNotRoutable,
    StaleVersion,
    BodyTooLarge,
    StreamInterrupted,
    EngineUnavailable,
    NoReplica,
    EngineRejected,
)
"""Every refusal the data plane answers itself: its OpenAPI document is written from this tuple,
and tests/test_error_docs.py checks that the proxy raises nothing else."""
_DONE = b"data: [DONE]"
# The end-of-stream event starts a line; model text inside a JSON payload never contains a raw
# newline, so "\ndata: [DONE]" cannot be matched inside an event's content.
_DONE_LINE = b"\n" + _DONE
_MODEL_RE = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)*)"')
# An error event (vLLM's and SGLang's ``data: {"error": ...}``) at a line start.
_ERROR_LINE = b'\ndata: {"error"'
# A versioned engine-side name (``policy@v3``) anywhere in an engine's error text.
_ENGINE_NAME_RE = re.compile(rb"([A-Za-z0-9][A-Za-z0-9._-]*)@v[0-9]+")
# An error event is held back until the stream ends, up to this many bytes.
_MAX_ERROR_TAIL = 64 << 10
# An event is held until it is whole, up to this many bytes (then it passes as it comes).
_MAX_EVENT = 1 << 20
# A pooled connection the engine closed while idle (uvicorn closes keep-alive connections after
# 5 s) fails like this when reused, before any response byte: resend once on a new connection.
_STALE_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# Nothing could be sent: the replica is down or unreachable; try another one.
_CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerTimeoutError,  # includes the connect timeout (aiohttp.ConnectionTimeoutError)
)
_FWD_HEADERS = {"Content-Type": "application/json"}
# ASGI header names are lower-case bytes.
_H_ADAPTER = ADAPTER_HEADER.lower().encode()
_H_VERSION = VERSION_HEADER.lower().encode()
_H_REPLICA = REPLICA_HEADER.lower().encode()
_H_SESSION = SESSION_HEADER.lower().encode()
_STREAM_OBJECT = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat.completion.chunk",
}


class _Unreachable(Exception):
    def __init__(self, detail: str, refused: bool) -> None:
        self.detail, self.refused = detail, refused


def _esc(s: str) -> bytes:
    """``s`` as the inside of a JSON string."""
    return json.dumps(s)[1:-1].encode()


class Proxy(Addressing):
    """Routes OpenAI-style requests to replicas by adapter version (``resolve``: what a
    request names, from ``Addressing``)."""

    def __init__(
        self,
        store: AliasStore,
        balancer: Balancer,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        *,
        fresh: aiohttp.ClientSession | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__(store, balancer)
        self.metrics = metrics
        self.session = session
        self.fresh = fresh or session
        """No connection reuse: where a request goes again after a stale pooled connection."""
        self._key = api_key or None
        self.native = Native(self)
        """SGLang's native ``/generate`` and abort (router/native.py)."""

    # --- entry ---------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        t0 = time.perf_counter()
        try:
            if self._key is not None:
                self._authorize(scope)
            body = await self._read_body(receive)
            try:
                req = json.loads(body)
            except ValueError as exc:
                raise InvalidRequest(f"body is not JSON: {exc}") from exc
            if not isinstance(req, dict):
                raise InvalidRequest("body must be a JSON object")
            session = None
            for k, v in scope["headers"]:
                if k == _H_SESSION:
                    session = v.decode("latin-1")
                    break
            if path == "/generate" and is_native_generate(req):
                await self.native.generate(send, receive, req, session)
                return
            route = self.resolve(req.get("model"), session)
            if path == "/generate":
                fwd, fwd_path = token_generate.as_completion(req, route), "/v1/completions"
            elif path == inference.INFERENCE_GENERATE:
                fwd, fwd_path = inference.check_request(req), path  # a copy: never the raw bytes
            else:
                fwd, fwd_path = req, path
            cands = self.balancer.candidates(route.replicas, route.base_model)
            if not cands:
                # Every replica holding this version looks unhealthy: try them anyway.
                cands = self.balancer.known(route.replicas, route.base_model)
                if cands:
                    self.metrics.panic.inc()
            if not cands:
                what = f"{route.adapter} v{route.version}" if route.adapter else route.alias
                raise NoReplica(f"no replica serves {what!r} right now")
        except ServiceError as exc:
            await send_error(send, exc)
            return
        key = (route.adapter, route.version)
        self.balancer.begin(key)  # same tick as resolve(): no await in between
        status = 0
        try:
            stream = req.get("stream") is True and path != "/generate"
            # A base-model request the router has nothing to change in goes out as the client's
            # own bytes; everything else is addressed per replica, in its engine's dialect.
            raw = (
                body
                if fwd is req and route.engine_name is None and "lora_path" not in req
                else None
            )
            forwarding = self._forward(
                scope, send, route, fwd_path, fwd, raw, cands, session,
                stream=stream, generate=path == "/generate",
            )  # fmt: skip
            # Streams can be long: watch for the client leaving so the count stays exact and the
            # engine stops generating. Plain requests end when the engine answers anyway.
            status = await (_watched(forwarding, receive) if stream else forwarding)
        finally:
            self.balancer.end(key)
            hist, _ = self.metrics.children(route.adapter, route.version)
            hist.observe(time.perf_counter() - t0)
            self.metrics.count(route.adapter, route.version, status)
            if route.adapter is not None:
                self.metrics.lag(route.adapter).observe(route.lag)

    # --- steps ---------------------------------------------------------------------------------

    def _authorize(self, scope) -> None:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        check_token(header, self._key, what="API key")

    @staticmethod
    async def _read_body(receive) -> bytes:
        msg = await receive()
        body = msg.get("body", b"")
        if not msg.get("more_body"):
            return body
        buf = bytearray(body)
        while msg.get("more_body"):
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise InvalidRequest("client went away")
            buf += msg.get("body", b"")
            if len(buf) > MAX_BODY:
                raise BodyTooLarge(f"body over {MAX_BODY} bytes")
        return bytes(buf)

    def _tag(self, route: Route, replica: Replica, engine_model: bytes | None) -> bytes:
        tag = {"adapter": route.adapter, "version": route.version, "replica": replica.replica_id}
        if engine_model is not None:
            tag["engine_model"] = engine_model.decode("utf-8", "replace")
        return json.dumps(tag, separators=(",", ":")).encode()

    @staticmethod
    def _tag_headers(route: Route, replica: Replica) -> list[tuple[bytes, bytes]]:
        return [
            (_H_ADAPTER, (route.adapter or "").encode()),
            (_H_VERSION, b"" if route.version is None else str(route.version).encode()),
            (_H_REPLICA, (replica.replica_id or "").encode()),
        ]

    async def _send(self, replica: Replica, path: str, data: bytes) -> aiohttp.ClientResponse:
        """POST to one replica. Raises ``_Unreachable`` when nothing came back from it.

        A reused connection that fails before the answer is no sign of a sick replica: the
        request is sent again, once, on a fresh connection, and only that outcome counts.
        """
        url = replica.engine_url + path
        try:
            try:
                return await self.session.post(url, data=data, headers=_FWD_HEADERS)
            except _CONNECT_ERRORS:
                raise
            except _STALE_ERRORS:
                self.metrics.stale_retries.inc()
                return await self.fresh.post(url, data=data, headers=_FWD_HEADERS)
        except (*_CONNECT_ERRORS, *_STALE_ERRORS) as exc:
            refused = (
                isinstance(exc, aiohttp.ClientConnectorError)
                and getattr(exc.os_error, "errno", None) == errno.ECONNREFUSED
            )
            raise _Unreachable(f"{type(exc).__name__}: {exc}", refused) from exc

    async def _forward(
        self,
        scope,
        send,
        route: Route,
        path: str,
        req: dict,
        raw: bytes | None,
        cands: list[Replica],
        session: str | None,
        *,
        stream: bool,
        generate: bool,
    ) -> int:
        """Send to one replica, once more to another if it could not be reached; the status."""
        failed: Replica | None = None
        for _ in range(2):
            replica = self.balancer.pick(cands, session, exclude=failed)
            if replica is None:
                break
            replica.inflight += 1
            sent_model = model_field(replica.kind, replica.base_model, route.engine_name)
            rpath, rreq, translated = self._native_request(path, req, replica)
            if raw is not None:
                data = raw
            else:
                data = json.dumps(
                    address(rreq, replica.kind, replica.base_model, route.engine_name)
                ).encode()
            placed_at = replica.agent_url
            try:
                try:
                    resp = await self._send(replica, rpath, data)
                except _Unreachable as exc:
                    # Refused means nothing listens: out of rotation at once. A timeout or a
                    # reset counts as one failure; a run of them takes the replica out. Not
                    # if it was re-placed meanwhile: that was its old address.
                    if replica.agent_url == placed_at:
                        self.balancer.failed(
                            replica, exc.detail, definitive=exc.refused, probe=False
                        )
                    failed = replica
                    self.metrics.retries.inc()
                    continue
                self.balancer.succeeded(replica, probe=False)
                try:
                    if await self._lacks_adapter(
                        replica, resp, route, retry=failed is None, cands=cands
                    ):
                        resp.release()
                        failed = replica
                        continue
                except BaseException:
                    resp.close()
                    raise
                try:
                    ctype = resp.headers.get("Content-Type", "")
                    if stream and resp.status == 200 and "text/event-stream" in ctype:
                        await self._stream(send, route, replica, resp, scope["path"], sent_model)
                        return resp.status
                    return await self._whole(
                        send, route, replica, resp, generate, sent_model, translated=translated
                    )
                except BaseException:
                    resp.close()  # never return a half-read connection to the pool
                    raise
                finally:
                    resp.release()
            finally:
                replica.inflight -= 1
        await send_error(
            send,
            EngineUnavailable(
                "could not connect to a replica" if failed else "no healthy replica right now"
            ),
        )
        return 503

    async def _lacks_adapter(
        self,
        replica: Replica,
        resp: aiohttp.ClientResponse,
        route: Route,
        *,
        retry: bool,
        cands: list[Replica],
    ) -> bool:
        """``hand_on`` for an answer not read yet (its body is read only when it may be that)."""
        if not retry or resp.status < 400 or route.engine_name is None:
            return False
        try:
            body = await resp.read()  # cached: _whole relays the same bytes if it is not that
        except (TimeoutError, aiohttp.ClientError):
            return False
        return self.hand_on(replica, route, resp.status, body, cands)

    def hand_on(
        self, replica: Replica, route: Route, status: int, body: bytes, cands: list[Replica]
    ) -> bool:
        """Whether a request goes on from ``replica`` to another candidate because its engine
        answered (``status``, ``body``) that it does not hold the version ``route`` names
        (``lacks_adapter`` of its kind). The table lists it for the version, yet the engine
        restarted empty, faster than the health poll could see: it leaves rotation until its
        agent says ready. With no other candidate, the engine's answer is relayed."""
        if (
            status < 400
            or route.engine_name is None
            or not any(c is not replica for c in cands)
            or not engine_kind(replica.kind).lacks_adapter(status, body)
        ):
            return False
        why = f"its engine does not hold {route.engine_name}"
        self.balancer.failed(replica, why, definitive=True, probe=False)
        self.metrics.retries.inc()
        return True

    async def _whole(
        self,
        send,
        route: Route,
        replica: Replica,
        resp: aiohttp.ClientResponse,
        generate: bool,
        sent_model: str | None,
        *,
        translated: bool = False,
    ) -> int:
        """Relay a whole answer (tagged if it is a 200 JSON body); the status sent.
        ``translated``: a completions answer to rebuild as ``/inference/v1/generate``'s."""
        try:
            body = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            await send_error(send, StreamInterrupted(_broke_off(exc)))
            return 502
        headers = self._tag_headers(route, replica)
        ctype = resp.headers.get("Content-Type", "application/json")
        rename = route.engine_name is not None and route.alias is not None and sent_model
        if resp.status != 200:
            # An engine's error must not show a client the engine-side names (policy@v3).
            body = self._scrub(body, route, sent_model)
        if resp.status == 200 and ctype.startswith("application/json"):
            if generate:
                body = token_generate.from_completion(body)
            if translated:
                try:
                    body = inference.from_completion(body)
                except ValueError as exc:
                    await send_error(send, EngineRejected(f"{replica.replica_id}: {exc}"))
                    return 502
            m = _MODEL_RE.search(body)
            engine_model = m.group(1) if m else None
            if m and rename and engine_model == _esc(sent_model):
                body = body[: m.start(1)] + _esc(route.alias) + body[m.end(1) :]
            body = body.rstrip()
            if body.endswith(b"}"):
                sep = b"" if body[:-1].rstrip().endswith(b"{") else b","
                tag = self._tag(route, replica, engine_model)
                body = body[:-1] + sep + b'"' + TAG_FIELD.encode() + b'":' + tag + b"}"
        headers.append((b"content-type", ctype.encode()))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return resp.status

    @staticmethod
    def _scrub(body: bytes, route: Route, sent_model: str | None) -> bytes:
        """An engine's error text with the client's alias for every engine-side name."""
        if route.alias is None:
            return _ENGINE_NAME_RE.sub(rb"\1", body)
        alias = _esc(route.alias)
        if route.engine_name is not None:
            # Longest first: ``tiny:p@v1`` must not lose its ``p@v1`` before it is replaced.
            internals = {sent_model, route.engine_name} - {None, "", route.alias}
            for internal in sorted(internals, key=len, reverse=True):  # type: ignore[arg-type]
                body = body.replace(_esc(internal), alias)
        # Any other versioned engine name loses its version; the client's own (a pinned
        # ``policy@v3``) stays as the client wrote it.
        return _ENGINE_NAME_RE.sub(lambda m: m[0] if m[0] == alias else m[1], body)

    @staticmethod
    def _native_request(path: str, req: dict, replica: Replica) -> tuple[str, dict, bool]:
        """Where and what to send one replica: ``/inference/v1/generate`` as is on vLLM, as a
        token-id completion elsewhere (``inference_generate``); other paths unchanged."""
        if path == inference.INFERENCE_GENERATE and inference.translated(replica.kind):
            return "/v1/completions", inference.as_completion(req), True
        return path, req, False

    async def _stream(
        self,
        send,
        route: Route,
        replica: Replica,
        resp: aiohttp.ClientResponse,
        path: str,
        sent_model: str | None,
    ) -> None:
        headers = self._tag_headers(route, replica)
        headers.append((b"content-type", b"text/event-stream; charset=utf-8"))
        headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        rewrite = route.engine_name is not None and route.alias is not None and sent_model
        if rewrite:
            eng, ali = _esc(sent_model), _esc(route.alias)
            pairs = [
                (b'"model":"' + eng + b'"', b'"model":"' + ali + b'"'),
                (b'"model": "' + eng + b'"', b'"model": "' + ali + b'"'),
            ]
        engine_model: bytes | None = None
        held = b""  # bytes after the last complete event: not sent yet
        done = False  # the engine's [DONE] was seen, and the tag sent just before it
        failed: bytearray | None = None  # the engine's error event and all after it
        broke: str | None = None
        try:
            async for chunk in resp.content.iter_any():
                if done:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    continue
                if failed is not None:
                    if len(failed) < _MAX_ERROR_TAIL:
                        failed += chunk
                    continue
                # Only whole events go out: a stream that breaks off mid-event must not leave
                # the client half an event before the error event.
                buf = held + chunk
                end = _events_end(buf)
                if end == 0 and len(buf) <= _MAX_EVENT:
                    held = buf
                    continue
                events, held = (buf[:end], buf[end:]) if end else (buf, b"")
                if engine_model is None:
                    m = _MODEL_RE.search(events)
                    if m:
                        engine_model = m.group(1)
                if rewrite:
                    for a, b in pairs:
                        events = events.replace(a, b)
                lined = b"\n" + events  # each block starts an event: a line start
                e, i = lined.find(_ERROR_LINE), lined.find(_DONE_LINE)
                if e >= 0 and (i < 0 or e < i):
                    events, failed = events[:e], bytearray(events[e:] + held)
                    held = b""
                elif i >= 0:
                    tag = self._tag_event(route, replica, engine_model, path)
                    events, done = events[:i] + tag + events[i:] + held, True
                if events:
                    await send({"type": "http.response.body", "body": events, "more_body": True})
        except (TimeoutError, aiohttp.ClientError) as exc:
            broke = _broke_off(exc)
        if not done and failed is None and broke is None:
            # The last event may lack its blank line: the engine's own end or error still count.
            last = held.strip()
            if last == _DONE:
                tag = self._tag_event(route, replica, engine_model, path)
                await send({"type": "http.response.body", "body": tag + held, "more_body": True})
                done = True
            elif last.startswith(_ERROR_LINE[1:]):
                failed = bytearray(held)
        if failed is not None:
            # The engine's own error event, passed on without engine-side names; then the end.
            tail = self._scrub(bytes(failed), route, sent_model).rstrip(b"\n") + b"\n\n"
            if _DONE_LINE not in b"\n" + tail:
                tail += _DONE + b"\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": True})
        elif not done:
            why = broke or "the engine's stream ended without data: [DONE]"
            await send({"type": "http.response.body", "body": _error_event(why), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def _tag_event(
        self, route: Route, replica: Replica, engine_model: bytes | None, path: str
    ) -> bytes:
        head = {
            "id": "lorafleet-tag",
            "object": _STREAM_OBJECT.get(path, "text_completion"),
            "created": int(time.time()),
            "model": route.alias,
            "choices": [],
        }
        doc = json.dumps(head, separators=(",", ":")).encode()
        tag = self._tag(route, replica, engine_model)
        return b"data: " + doc[:-1] + b',"' + TAG_FIELD.encode() + b'":' + tag + b"}\n\n"


async def _watched(fwd, receive) -> int:
    """Run ``fwd``; cancel it if the client disconnects first (status 499 then)."""
    task = asyncio.ensure_future(fwd)

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


def _broke_off(exc: BaseException) -> str:
    return f"the engine's answer broke off: {type(exc).__name__}: {exc}"


def _error_event(message: str) -> bytes:
    """An SSE error event in the protocol's envelope, then the end of the stream."""
    exc = StreamInterrupted(message)
    doc = json.dumps(error_body(exc.code, exc.message), separators=(",", ":")).encode()
    return b"data: " + doc + b"\n\n" + _DONE + b"\n\n"
