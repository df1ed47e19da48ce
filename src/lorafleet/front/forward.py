"""Generation forwarded to the data plane (the router, or its copies: ``FrontConfig.inference``):
``model`` mapped to the router's pin and back.
Every trainer dialect forwards generation the same way: the body goes to the router's path of
the same name with the router's API key, a trainer's versioned name (``trl-policy-v7``) becomes
the router's pin (``trl-policy@v7``), and the answer (stream or not) names the model as the
trainer sent it. lorafleet's version headers and error code pass through.

``forward_gated`` adds the pause of ``lorafleet.front.gate``: held while paused, and a
non-streaming request a pause aborts is answered with the dialect's own aborted answer.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lorafleet._service import read_json
from lorafleet.errors import EngineUnavailable, InvalidRequest
from lorafleet.front.gate import Aborted
from lorafleet.front.service import Front
from lorafleet.protocol.errors import ERROR_CODE_HEADER
from lorafleet.protocol.router import ADAPTER_HEADER, REPLICA_HEADER, SESSION_HEADER, VERSION_HEADER
from lorafleet.protocol.tenants import Caller

__all__ = [
    "GENERATION_BODY_LIMIT",
    "caller_of",
    "forward_gated",
    "forward_generation",
    "read_object",
]

GENERATION_BODY_LIMIT = 64 << 20
# The session pins a rollout to one version; a client's request id is passed on for its logs.
_PASS_HEADERS = (SESSION_HEADER.lower(), "x-request-id")
_ANSWER_HEADERS = (
    ADAPTER_HEADER.lower(),
    VERSION_HEADER.lower(),
    REPLICA_HEADER.lower(),
    ERROR_CODE_HEADER.lower(),
    "retry-after",
)


def caller_of(front: Front, request: Request) -> Caller:
    """Who a generation or read comes from (``Front.check_reader``)."""
    client = request.client.host if request.client else None
    return front.check_reader(request.headers.get("authorization"), client)


async def read_object(request: Request) -> dict:
    """The request's JSON body, which must be an object. Raises ``InvalidRequest``."""
    body = await read_json(request, GENERATION_BODY_LIMIT)
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


async def forward_generation(
    front: Front,
    request: Request,
    body: dict,
    *,
    path: str | None = None,
    model_field: str = "model",
) -> Response:
    """Send ``body`` to the router's ``path`` (default: the request's) and relay the answer."""
    sent = body.get(model_field)
    routed = await front.route_model(sent, caller_of(front, request))
    if routed is not None:
        body[model_field] = routed
    headers = {"content-type": "application/json"}
    if front.cfg.api_key:
        headers["authorization"] = f"Bearer {front.cfg.api_key}"
    for h in _PASS_HEADERS:
        if h in request.headers:
            headers[h] = request.headers[h]
    url = front.inference_url + (path or request.url.path)
    req = front.http.build_request("POST", url, content=json.dumps(body), headers=headers)
    try:
        resp = await front.http.send(req, stream=True)
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"data plane {front.inference_url} unreachable: {exc}") from exc
    out_headers = {k: v for k, v in resp.headers.items() if k.lower() in _ANSWER_HEADERS}
    rename = (routed.encode(), str(sent).encode()) if routed is not None else None
    ctype = resp.headers.get("content-type", "application/json")
    if ctype.startswith("text/event-stream"):
        return StreamingResponse(
            _events(resp, rename),
            status_code=resp.status_code,
            headers=out_headers,
            media_type=ctype,
        )
    try:
        raw = await resp.aread()
    finally:
        await resp.aclose()
    if rename is not None:
        raw = _rename_whole(raw, *rename, ok=resp.status_code == 200)
    return Response(raw, status_code=resp.status_code, headers=out_headers, media_type=ctype)


async def forward_gated(
    front: Front,
    request: Request,
    body: dict,
    aborted: Callable[[dict], dict],
    *,
    path: str | None = None,
    model_field: str = "model",
    rid: str | None = None,
) -> Response:
    """``forward_generation`` through the front's gate; ``aborted(body as the trainer sent it)``
    is the answer when a pause cuts the request off. ``rid``: the request's id at the router,
    whose ``/abort_request`` then ends it with its partial answer instead. A stream is held
    while paused, never aborted (its answer has begun): it runs to its end."""
    sent = copy.deepcopy(body)

    async def abort_at_router() -> None:
        headers = {"authorization": f"Bearer {front.cfg.api_key}"} if front.cfg.api_key else {}
        r = await front.http.post(
            front.inference_url + "/abort_request", json={"rid": rid}, headers=headers, timeout=10
        )
        r.raise_for_status()

    try:
        return await front.gate.run(
            lambda: forward_generation(front, request, body, path=path, model_field=model_field),
            abortable=not body.get("stream"),
            abort=abort_at_router if rid is not None else None,
        )
    except Aborted:
        return JSONResponse(aborted(sent))


def _rename_whole(raw: bytes, routed: bytes, sent: bytes, *, ok: bool) -> bytes:
    """The router's answer with ``model`` as the trainer sent it (the version tag stays)."""
    if ok:
        with contextlib.suppress(ValueError):
            out = json.loads(raw)
            if isinstance(out, dict) and out.get("model") == routed.decode():
                out["model"] = sent.decode()
                return json.dumps(out).encode()
        return raw
    return raw.replace(b"`" + routed + b"`", b"`" + sent + b"`")


async def _events(resp: httpx.Response, rename: tuple[bytes, bytes] | None) -> AsyncIterator[bytes]:
    """Relay an SSE stream event by event, renaming ``model`` in each ``data:`` event."""
    try:
        if rename is None:
            async for chunk in resp.aiter_raw():
                yield chunk
            return
        buf = b""
        async for chunk in resp.aiter_raw():
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            if events:
                yield b"".join(_rename_event(e, *rename) + b"\n\n" for e in events)
        if buf:
            yield _rename_event(buf, *rename)
    finally:
        await resp.aclose()


def _rename_event(event: bytes, routed: bytes, sent: bytes) -> bytes:
    if not event.startswith(b"data: {"):
        return event
    with contextlib.suppress(ValueError):
        out = json.loads(event[6:])
        if out.get("model") == routed.decode():
            out["model"] = sent.decode()
            return b"data: " + json.dumps(out).encode()
    return event
