"""One vLLM server's API, as TRL's ``VLLMClient`` and prime-rl call it.

Loads are lorafleet publications (``trl-policy-v7`` is version 7 of ``trl-policy``); unloads
retire a version; generation goes through the router. Pause and resume are acknowledged only:
lorafleet's loads are atomic flips, so generation keeps flowing and nothing needs freezing.

``areal_routes`` adds what AReaL's own vLLM server (``areal.engine.vllm_ext``) adds to vLLM's:
``/areal_pause_generation`` aborts the generations in flight through this front (they answer
with finish reason ``abort``) and holds new ones until ``/areal_continue_generation``, as that
server does (``lorafleet.front.gate``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import PlainTextResponse, Response

from lorafleet._service import errors, streamed_ok
from lorafleet.errors import InvalidRequest
from lorafleet.front.dialects._openapi import route_doc
from lorafleet.front.forward import caller_of, forward_gated, read_object
from lorafleet.front.service import Front
from lorafleet.protocol.front import PAUSE_MODES, FrontLoadRequest, FrontUnloadRequest
from lorafleet.protocol.router import ADAPTER_HEADER, VERSION_HEADER
from lorafleet.protocol.tenants import Caller

__all__ = ["aborted_chat", "aborted_completion", "areal_routes", "openai_generate", "routes"]


def routes(front: Front, control: Depends) -> APIRouter:
    """vLLM's reads, LoRA control and OpenAI generation routes over ``front``."""
    r = APIRouter()
    ctl = [control]

    @r.get("/v1/models", **route_doc(None, 401, 403, 503))
    async def models(request: Request) -> dict:
        return await front.models(caller_of(front, request))

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

    async def load(req: FrontLoadRequest, caller: Caller = control) -> Response:
        result = await front.load(req.lora_name, req.lora_path, caller)
        headers = {ADAPTER_HEADER: result.name, VERSION_HEADER: str(result.version)}
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' added successfully "
            f"(lorafleet {result.name} v{result.version} on {len(result.replicas)} replicas).",
            headers=headers,
        )

    async def unload(req: FrontUnloadRequest, caller: Caller = control) -> Response:
        done = await front.unload(req.lora_name, caller)
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

    openai_body = {"type": "object"}
    streamed = streamed_ok("The router's answer, tagged (JSON, or events when stream is true)")
    for path in ("/v1/completions", "/v1/chat/completions"):
        doc = route_doc(openai_body, 401, 409, 413, 502, 503, relayed=(400, 403, 404), ok=streamed)
        r.post(path, **doc)(openai_generate(front))
    return r


def openai_generate(front: Front) -> Callable[[Request], Awaitable[Response]]:
    """The route that forwards OpenAI generation to the router's path of the same name."""

    async def generate(request: Request) -> Response:
        aborted = aborted_chat if request.url.path.endswith("/chat/completions") else None
        return await forward_gated(
            front, request, await read_object(request), aborted or aborted_completion
        )

    return generate


def areal_routes(front: Front, control: Depends) -> APIRouter:
    """AReaL's vLLM server routes: its pause and continue (``RemotevLLMEngine``)."""
    r = APIRouter()
    ctl = [control]

    @r.post("/areal_pause_generation", dependencies=ctl, responses=errors(401, 403))
    async def areal_pause() -> dict:
        report = await front.gate.pause("abort")
        return {
            "success": True,
            "message": "Generation paused and all requests aborted",
            "lorafleet": report.words(),
        }

    @r.post("/areal_continue_generation", dependencies=ctl, responses=errors(401, 403))
    async def areal_continue() -> dict:
        front.gate.resume()
        return {"success": True, "message": "Generation continued"}

    return r


def _usage(prompt: object) -> dict:
    n = len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else 0
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def aborted_completion(body: dict) -> dict:
    """vLLM's ``/v1/completions`` answer for a request aborted before it produced output."""
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    choice = {
        "index": 0,
        "text": "",
        "logprobs": logprobs,
        "finish_reason": "abort",
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = []
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [choice],
        "usage": _usage(body.get("prompt")),
    }


def aborted_chat(body: dict) -> dict:
    """vLLM's ``/v1/chat/completions`` answer for a request aborted before any output."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "", "tool_calls": []},
                "logprobs": {"content": []} if body.get("logprobs") else None,
                "finish_reason": "abort",
                "stop_reason": None,
            }
        ],
        "usage": _usage(None),
    }
