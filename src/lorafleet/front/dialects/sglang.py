"""One SGLang 0.5.23 server's API, as AReaL's ``RemoteSGLangEngine`` drives it (disk mode).

Loads are lorafleet publications (``policy-v3`` is version 3 of ``policy``; ``policy-v0`` is the
base model and never loaded), verified on every replica and atomic; the front has taken the
bytes before it answers, so the trainer may delete the directory next. Unloads are best effort,
as on SGLang: a version still routable stops being served, one already gone answers success.
Pause and continue are SGLang's (``lorafleet.front.gate``): in ``abort`` mode, its default, the
generations in flight through this front end at once with finish reason ``abort`` and new ones
wait for ``continue``. ``/generate`` goes to the router's SGLang-native ``/generate`` with
``lora_path`` mapped to the router's pin.

Success bodies are SGLang's, field for field. A refusal keeps SGLang's body
(``success: false``, ``error_message``) with lorafleet's precise status and error code added.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from lorafleet._service import error_parts, errors
from lorafleet.errors import ServiceError
from lorafleet.front.dialects.vllm import openai_generate
from lorafleet.front.forward import caller_of, forward_gated, read_object
from lorafleet.front.service import Front
from lorafleet.protocol.front import (
    ContinueGenerationRequest,
    FrontSGLangLoadRequest,
    FrontSGLangUnloadRequest,
    PauseGenerationRequest,
    SGLangLoRAUpdateOutput,
)
from lorafleet.protocol.router import ADAPTER_HEADER, VERSION_HEADER
from lorafleet.protocol.tenants import Caller

__all__ = ["SGLANG_VERSION", "aborted_generate", "routes"]

SGLANG_VERSION = "0.5.23"


def routes(front: Front, control: Depends) -> APIRouter:
    """SGLang's reads, pause, LoRA control and native generation over ``front``."""
    r = APIRouter()
    ctl = [control]

    @r.get(
        "/health_generate", response_class=Response, responses={200: {"description": "Up (empty)"}}
    )
    async def health_generate() -> Response:
        return Response(status_code=200)

    async def model_info() -> dict:
        base = await front.base_model()
        config = _model_config(base.get("root"))
        return {
            "model_path": base.get("root"),
            "served_model_name": base["id"],
            "tokenizer_path": base.get("root"),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
        }

    for path in ("/model_info", "/get_model_info"):
        r.get(path, responses=errors(503))(model_info)

    async def server_info() -> dict:
        base = await front.base_model()
        infos = await front.agent_infos()
        ranks = [i.capabilities.max_lora_rank for i in infos if i.capabilities.max_lora_rank]
        return {
            "model_path": base.get("root"),
            "tokenizer_path": base.get("root"),
            "served_model_name": base["id"],
            "enable_lora": True,
            "max_lora_rank": min(ranks) if ranks else None,
            "max_loaded_loras": front.cfg.keep_versions + 1,
            "lora_paths": None,
            "context_length": base.get("max_model_len"),
            "dp_size": 1,
            "tp_size": 1,
            "internal_states": [],
            "version": SGLANG_VERSION,
            "frontend": "lorafleet",
            "lorafleet": {
                "replicas": len(infos),
                "router": front.router_url,
                "keep_versions": front.cfg.keep_versions,
            },
        }

    for path in ("/server_info", "/get_server_info"):
        r.get(path, responses=errors(503))(server_info)

    @r.get("/v1/models", responses=errors(401, 403, 503))
    async def models(request: Request) -> dict:
        return await front.models(caller_of(front, request))

    @r.post("/pause_generation", dependencies=ctl, responses=errors(400, 401, 403, 413))
    async def pause_generation(req: PauseGenerationRequest) -> dict:
        report = await front.gate.pause(req.mode)
        return {
            "message": "Generation paused successfully.",
            "status": "ok",
            "lorafleet": report.words(),
        }

    @r.post("/continue_generation", dependencies=ctl, responses=errors(400, 401, 403, 413))
    async def continue_generation(req: ContinueGenerationRequest) -> dict:
        front.gate.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @r.post(
        "/load_lora_adapter",
        dependencies=ctl,
        response_model=SGLangLoRAUpdateOutput,
        responses=errors(400, 401, 403, 404, 409, 413, 422, 502, 503),
    )
    async def load(req: FrontSGLangLoadRequest, caller: Caller = control) -> Response:
        try:
            result = await front.load(req.lora_name, req.lora_path, caller)
        except ServiceError as exc:
            return _refusal(exc)
        headers = {ADAPTER_HEADER: result.name, VERSION_HEADER: str(result.version)}
        return JSONResponse(await _update_output(front), headers=headers)

    @r.post(
        "/unload_lora_adapter",
        dependencies=ctl,
        response_model=SGLangLoRAUpdateOutput,
        responses=errors(400, 401, 403, 404, 409, 413, 503),
    )
    async def unload(req: FrontSGLangUnloadRequest, caller: Caller = control) -> Response:
        try:
            await front.unload(req.lora_name, caller)
        except ServiceError as exc:
            return _refusal(exc)
        return JSONResponse(await _update_output(front))

    @r.post("/generate", responses=errors(400, 401, 403, 404, 409, 413, 502, 503))
    async def generate(request: Request) -> Response:
        body = await read_object(request)
        if "lora_path" in body:
            caller = caller_of(front, request)
            body["lora_path"] = await front.route_lora_path(body["lora_path"], caller)
            if body["lora_path"] is None:
                del body["lora_path"]
        # One prompt gets a rid, so that a pause can abort it at the router and still answer
        # what it generated (AReaL then resends prompt + those tokens).
        rid = None
        if _single(body) and not body.get("stream"):
            if not isinstance(body.get("rid"), str):
                body["rid"] = f"lorafleet-front-{uuid.uuid4().hex}"
            rid = body["rid"]
        return await forward_gated(front, request, body, aborted_generate, rid=rid)

    # SGLang serves OpenAI's routes too; they go to the router's, as on the vLLM dialect.
    for path in ("/v1/completions", "/v1/chat/completions"):
        r.post(path, responses=errors(400, 401, 403, 404, 409, 413, 502, 503))(
            openai_generate(front)
        )
    return r


async def _update_output(front: Front) -> dict:
    """SGLang's successful ``LoRAUpdateOutput``: the adapters loaded through this front that are
    still served, by the names the trainer gave them, with the paths it loaded them from."""
    loaded = {}
    for name, entry in sorted((await front.aliases(0.0)).items()):
        for rv in entry.window():
            key = (name, rv.version)
            if key in front.loaded and key not in front.retired:
                lora_name, path = front.loaded[key]
                loaded[lora_name] = path
    return {
        "rid": None,
        "http_worker_ipc": None,
        "success": True,
        "error_message": "",
        "loaded_adapters": loaded,
    }


def _refusal(exc: ServiceError) -> Response:
    """SGLang's failed ``LoRAUpdateOutput``, with lorafleet's status, code and envelope."""
    status, headers, raw = error_parts(exc)
    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": False,
        "error_message": exc.message,
        "loaded_adapters": None,
        **json.loads(raw),
    }
    return JSONResponse(body, status_code=status, headers=headers)


def _single(body: dict) -> bool:
    """Whether a ``/generate`` body is one prompt (ids or text), not a batch."""
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None:
        return isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    return isinstance(text, str)


def aborted_generate(body: dict) -> Any:
    """SGLang's answer to a ``/generate`` aborted before it produced output: finish reason
    ``abort``, no tokens (AReaL resends the prompt). A batch answers one item per prompt."""
    prompts = body.get("input_ids", body.get("text"))
    batch = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
    items = prompts if batch else [prompts]
    rids = body.get("rid") if isinstance(body.get("rid"), list) else [body.get("rid")] * len(items)
    out = []
    for prompt, rid in zip(items, rids, strict=False):
        meta: dict[str, Any] = {
            "id": rid if isinstance(rid, str) else uuid.uuid4().hex,
            "finish_reason": {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            },
            "prompt_tokens": len(prompt) if isinstance(prompt, list) else 0,
            "weight_version": "default",
            "completion_tokens": 0,
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = []
        out.append({"text": "", "output_ids": [], "meta_info": meta})
    return out if batch else out[0]


def _model_config(root: object) -> dict:
    """The base model's config.json where the front can read it (a local model), else {}."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        config = json.loads((Path(str(root)) / "config.json").read_text())
        if isinstance(config, dict):
            return config
    return {}
