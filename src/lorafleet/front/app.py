"""The front's HTTP glue: one vLLM server's routes over ``lorafleet.front.service.Front``.

Control calls (load, unload, pause, resume) pass ``Front.check_control``; reads (health, models,
server_info) are open, as on vLLM. Generation is forwarded to the router with the router's API
key, ``model`` mapped to the router's pin and mapped back in the answer (stream or not).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from lorafleet._service import JsonBodyLimit, install_error_handlers, read_json
from lorafleet.errors import EngineUnavailable, InvalidRequest
from lorafleet.front.service import Front, FrontConfig
from lorafleet.protocol.front import (
    PAUSE_MODES,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from lorafleet.protocol.router import ADAPTER_HEADER, REPLICA_HEADER, VERSION_HEADER

__all__ = ["create_app"]

GENERATION_BODY_LIMIT = 64 << 20
_PASS_HEADERS = ("x-session-id", "x-request-id")
_ANSWER_HEADERS = (ADAPTER_HEADER.lower(), VERSION_HEADER.lower(), REPLICA_HEADER.lower())


def create_app(cfg: FrontConfig) -> FastAPI:
    """The front's ASGI app. Raises ``ValueError`` for an unusable configuration."""
    front = Front(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await front.aclose()

    app = FastAPI(title="lorafleet front", lifespan=lifespan)
    app.state.front = front
    install_error_handlers(app)
    app.add_middleware(JsonBodyLimit, limit=GENERATION_BODY_LIMIT)

    def control(request: Request) -> None:
        client = request.client.host if request.client else None
        front.check_control(request.headers.get("authorization"), client)

    ctl = [Depends(control)]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return await front.models()

    @app.get("/server_info")
    async def server_info(config_format: str = "text") -> dict:
        return await front.server_info()

    @app.get("/get_world_size")
    async def world_size() -> dict:
        return {"world_size": 1}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": front.paused}

    @app.post("/pause", dependencies=ctl)
    async def pause(mode: str = "abort", clear_cache: bool = True) -> dict:
        # Acknowledged only: lorafleet's loads are atomic flips, so generation keeps flowing and
        # nothing needs freezing. The state is kept for /is_paused.
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(PAUSE_MODES)}", param="mode")
        front.paused = True
        return {"status": "paused", "mode": mode, "lorafleet": "acknowledged; nothing paused"}

    @app.post("/resume", dependencies=ctl)
    async def resume() -> dict:
        front.paused = False
        return {"status": "resumed"}

    async def load(req: LoadLoRAAdapterRequest) -> Response:
        result = await front.load(req.lora_name, req.lora_path)
        headers = {ADAPTER_HEADER: result.name, VERSION_HEADER: str(result.version)}
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' added successfully "
            f"(lorafleet {result.name} v{result.version} on {len(result.replicas)} replicas).",
            headers=headers,
        )

    async def unload(req: UnloadLoRAAdapterRequest) -> Response:
        done = await front.unload(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed: {done}.")

    for path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
        app.post(path, dependencies=ctl)(load)
    for path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
        app.post(path, dependencies=ctl)(unload)

    async def generate(request: Request) -> Response:
        body = await read_json(request, GENERATION_BODY_LIMIT)
        if not isinstance(body, dict):
            raise InvalidRequest("body must be a JSON object")
        sent = body.get("model")
        routed = await front.route_model(sent)
        if routed is not None:
            body["model"] = routed
        headers = {"content-type": "application/json"}
        if cfg.api_key:
            headers["authorization"] = f"Bearer {cfg.api_key}"
        for h in _PASS_HEADERS:
            if h in request.headers:
                headers[h] = request.headers[h]
        url = front.router_url + request.url.path
        req = front.http.build_request("POST", url, content=json.dumps(body), headers=headers)
        try:
            resp = await front.http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"router {front.router_url} unreachable: {exc}") from exc
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() in _ANSWER_HEADERS}
        for k in ("x-lorafleet-error-code", "retry-after"):
            if k in resp.headers:
                out_headers[k] = resp.headers[k]
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

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.post(path)(generate)
    return app


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
