"""One vLLM server's API, as TRL's ``VLLMClient`` and prime-rl call it.

Loads are lorafleet publications (``trl-policy-v7`` is version 7 of ``trl-policy``); unloads
retire a version; generation goes through the router. Pause and resume are acknowledged only:
lorafleet's loads are atomic flips, so generation keeps flowing and nothing needs freezing.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import PlainTextResponse, Response

from lorafleet._service import streamed_ok
from lorafleet.errors import InvalidRequest
from lorafleet.front.dialects._openapi import route_doc
from lorafleet.front.forward import forward_generation, read_object
from lorafleet.front.service import Front
from lorafleet.protocol.front import PAUSE_MODES, FrontLoadRequest, FrontUnloadRequest
from lorafleet.protocol.router import ADAPTER_HEADER, VERSION_HEADER

__all__ = ["routes"]


def routes(front: Front, control: Depends) -> APIRouter:
    """vLLM's reads, LoRA control and OpenAI generation routes over ``front``."""
    r = APIRouter()
    ctl = [control]

    @r.get("/v1/models", **route_doc(None, 503))
    async def models() -> dict:
        return await front.models()

    @r.get("/server_info", **route_doc(None, 400, 503))
    async def server_info(config_format: str = "text") -> dict:
        return await front.server_info()

    @r.get("/get_world_size")
    async def world_size() -> dict:
        return {"world_size": 1}

    @r.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": front.paused}

    @r.post("/pause", dependencies=ctl, **route_doc(None, 400, 401, 403))
    async def pause(mode: str = "abort", clear_cache: bool = True) -> dict:
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(PAUSE_MODES)}", param="mode")
        front.paused = True
        return {"status": "paused", "mode": mode, "lorafleet": "acknowledged; nothing paused"}

    @r.post("/resume", dependencies=ctl, **route_doc(None, 401, 403))
    async def resume() -> dict:
        front.paused = False
        return {"status": "resumed"}

    async def load(req: FrontLoadRequest) -> Response:
        result = await front.load(req.lora_name, req.lora_path)
        headers = {ADAPTER_HEADER: result.name, VERSION_HEADER: str(result.version)}
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' added successfully "
            f"(lorafleet {result.name} v{result.version} on {len(result.replicas)} replicas).",
            headers=headers,
        )

    async def unload(req: FrontUnloadRequest) -> Response:
        done = await front.unload(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed: {done}.")

    control_errors = (400, 401, 403, 404, 409, 413)
    for path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
        r.post(
            path,
            dependencies=ctl,
            **route_doc(FrontLoadRequest, *control_errors, 422, 502, 503, text_ok=True),
        )(load)
    for path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
        r.post(
            path,
            dependencies=ctl,
            **route_doc(FrontUnloadRequest, *control_errors, 503, text_ok=True),
        )(unload)

    async def generate(request: Request) -> Response:
        return await forward_generation(front, request, await read_object(request))

    openai_body = {"type": "object"}
    streamed = streamed_ok("The router's answer, tagged (JSON, or events when stream is true)")
    for path in ("/v1/completions", "/v1/chat/completions"):
        doc = route_doc(openai_body, 409, 413, 502, 503, relayed=(400, 403, 404), ok=streamed)
        r.post(path, **doc)(generate)
    return r
