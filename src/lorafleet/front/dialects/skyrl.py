"""SkyRL's inference-server API, as SkyRL 0.4.0's ``RemoteInferenceClient`` calls it (with the
front as both its ``proxy_url`` and its one ``server_urls`` entry), plus the remote-upload calls
of SkyRL's LoRA-publication pull request. Used together with the vLLM dialect's routes
(``/pause``, ``/resume``, ``/get_world_size``, ``/v1/models``, OpenAI generation); a route here
takes precedence over the vLLM group's route of the same path (``/v1/unload_lora_adapter``).

- A load (``lora_path`` under ``--shared-dir``, or ``upload_id``) is one lorafleet publication to
  every replica: ``skyrl-lora`` loaded again is the next version of ``skyrl-lora``. A failed
  publication answers with an error (SkyRL then fails closed) and the previous version serves.
- An unload of ``skyrl-lora`` retires the name (``Front.retire_name``).
- Generation (``/inference/v1/generate``) goes through the router, which routes by ``model`` and
  keeps an ``X-Session-ID`` on the version it started on, and tags every answer.
- ``/reset_prefix_cache`` reaches every engine with a prefix cache; ``/collective_rpc`` answers
  only the in-memory-LoRA discard (a no-op: nothing is ever staged in GPU memory here).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi import Path as FastAPIPath
from fastapi.params import Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from lorafleet.engine_kinds import EngineReply
from lorafleet.errors import Forbidden, InvalidRequest
from lorafleet.front.dialects._openapi import route_doc
from lorafleet.front.forward import forward_generation, read_object
from lorafleet.front.service import Front
from lorafleet.protocol.front import FrontUnloadRequest
from lorafleet.protocol.router import ADAPTER_HEADER, VERSION_HEADER
from lorafleet.protocol.skyrl import (
    UPLOAD_SHA256_HEADER,
    UPLOAD_SIZE_HEADER,
    CollectiveRpcRequest,
    ResetPrefixCacheRequest,
    SkyRLLoadRequest,
    SkyRLLoadResponse,
    UploadedFile,
    parse_upload_id,
    parse_upload_sha256,
    parse_upload_size,
)
from lorafleet.protocol.tenants import Caller

__all__ = ["UPLOAD_PREFIX", "routes"]

UPLOAD_PREFIX = "/skyrl/v1/lora-adapters/"
"""PUTs under this path stream raw bytes: the front's JSON body limit does not apply to them."""

IN_MEMORY_REFUSAL = (
    "in_memory LoRA loading (lora.sync_mode=memory: CUDA-IPC/NCCL staging into the engine's "
    "workers) cannot reach a lorafleet fleet. Use trainer.policy.model.lora.lora_sync_path on a "
    "directory under this front's --shared-dir (shared filesystem), or remote upload (PUT "
    "/skyrl/v1/lora-adapters/{upload_id}/{file}, then load with upload_id)."
)
DISCARD_IN_MEMORY = "skyrl_discard_in_memory_lora"

UploadId = Annotated[str, FastAPIPath(max_length=64)]
FileName = Annotated[str, FastAPIPath(max_length=64)]


def _upload_id(value: str) -> str:
    try:
        return parse_upload_id(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="upload_id") from None


def _model(model: type, body: dict):
    """``body`` as ``model``; a validation failure is a 400 naming the first problem."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        msg = str(first.get("msg", "invalid body")).removeprefix("Value error, ")
        raise InvalidRequest(f"{where + ': ' if where else ''}{msg}", param=where or None) from None


_CONTROL = (400, 401, 403)
_TOKEN_IN = {
    "type": "object",
    "required": ["token_ids", "sampling_params"],
    "properties": {
        "model": {"type": "string"},
        "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        "sampling_params": {"type": "object"},
    },
}


def routes(front: Front, control: Depends) -> APIRouter:
    """SkyRL's LoRA control, remote upload, token-in generation and helper routes over ``front``."""
    r = APIRouter()
    ctl = [control]

    @r.post(
        "/skyrl/v1/load_lora_adapter",
        dependencies=ctl,
        response_model=SkyRLLoadResponse,
        **route_doc(SkyRLLoadRequest, *_CONTROL, 404, 409, 422, 502, 503),
    )
    async def load(request: Request, caller: Caller = control) -> Response:
        req: SkyRLLoadRequest = _model(SkyRLLoadRequest, await read_object(request))
        if req.in_memory:
            raise InvalidRequest(IN_MEMORY_REFUSAL, param="in_memory")
        if req.upload_id is not None:
            result = await front.load_upload(req.lora_name, _upload_id(req.upload_id), caller)
        else:
            assert req.lora_path is not None
            result = await front.load(req.lora_name, req.lora_path, caller)
        body = SkyRLLoadResponse(
            lora_name=req.lora_name,
            lora_int_id=result.version,
            lorafleet={
                "adapter": result.name,
                "version": result.version,
                "replicas": len(result.replicas),
            },
        )
        headers = {ADAPTER_HEADER: result.name, VERSION_HEADER: str(result.version)}
        return JSONResponse(body.model_dump(), headers=headers)

    @r.put(
        UPLOAD_PREFIX + "{upload_id}/{filename}",
        dependencies=ctl,
        response_model=UploadedFile,
        **route_doc(
            {"type": "string", "format": "binary"},
            *_CONTROL,
            413,
            headers=(UPLOAD_SHA256_HEADER, UPLOAD_SIZE_HEADER),
        ),
    )
    async def upload(
        upload_id: UploadId, filename: FileName, request: Request, caller: Caller = control
    ) -> dict:
        uid = front.upload_key(caller, _upload_id(upload_id))
        if front.uploads is None:
            raise Forbidden(
                "remote upload is off on this front: start it with --upload-dir (or load by a "
                "lora_path under its --shared-dir)"
            )
        try:
            sha = parse_upload_sha256(request.headers.get(UPLOAD_SHA256_HEADER))
            size = parse_upload_size(request.headers.get(UPLOAD_SIZE_HEADER))
        except ValueError as exc:
            front.uploads.discard(uid)
            raise InvalidRequest(str(exc)) from None
        done = await front.uploads.put(uid, filename, size, sha, request.stream())
        return done.model_dump()

    @r.delete(UPLOAD_PREFIX + "{upload_id}", dependencies=ctl, **route_doc(None, *_CONTROL))
    async def discard(upload_id: UploadId, caller: Caller = control) -> dict:
        uid = front.upload_key(caller, _upload_id(upload_id))
        if front.uploads is not None:
            front.uploads.discard(uid)
        return {"status": "ok"}

    async def unload(request: Request, caller: Caller = control) -> Response:
        req: FrontUnloadRequest = _model(FrontUnloadRequest, await read_object(request))
        done = await front.retire_name(req.lora_name, caller)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed: {done}.")

    for path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
        r.post(
            path,
            dependencies=ctl,
            **route_doc(FrontUnloadRequest, *_CONTROL, 404, 409, 503, text_ok=True),
        )(unload)

    @r.post("/reset_prefix_cache", dependencies=ctl, **route_doc(None, *_CONTROL, 503))
    async def reset_prefix_cache(request: Request) -> dict:
        raw = await request.body()
        req = ResetPrefixCacheRequest()
        if raw.strip():
            req = _model(ResetPrefixCacheRequest, await read_object(request))
        reset = request.query_params.get("reset_running_requests")
        running = req.reset_running_requests or (reset or "").lower() == "true"
        outcomes = await front.reset_prefix_caches(running)
        return {"success": True, "lorafleet": {"engines": outcomes}}

    @r.post("/collective_rpc", dependencies=ctl, **route_doc(CollectiveRpcRequest, *_CONTROL))
    async def collective_rpc(request: Request) -> dict:
        req: CollectiveRpcRequest = _model(CollectiveRpcRequest, await read_object(request))
        if req.method == DISCARD_IN_MEMORY:
            return {"results": [None], "lorafleet": "no in-memory LoRA is ever staged here"}
        raise InvalidRequest(
            f"collective_rpc {req.method!r} is not available through lorafleet: it moves "
            "weights by NCCL or CUDA IPC into the engine's workers, which a fleet does not "
            "expose. Sync LoRA adapters through /skyrl/v1/load_lora_adapter instead.",
            param="method",
        )

    @r.post(
        "/inference/v1/generate",
        **route_doc(_TOKEN_IN, 401, 413, 409, 502, 503, relayed=(400, 403, 404)),
    )
    async def generate(request: Request) -> Response:
        return await forward_generation(front, request, await read_object(request))

    @r.post("/skyrl/v1/generate", **route_doc(_TOKEN_IN, 400, 413))
    async def skyrl_generate(request: Request) -> Response:
        await read_object(request)
        raise InvalidRequest(
            "/skyrl/v1/generate returns routed experts (R3) or the sampler's support set as "
            "packed side channels, which lorafleet's engines do not produce. Set "
            "generator.inference_engine.enable_return_routed_experts=false and leave "
            "return_sample_support unset; /inference/v1/generate serves token-in token-out.",
            code="invalid_request",
        )

    def relayed(reply: EngineReply) -> Response:
        return Response(reply.content, status_code=reply.status_code, media_type=reply.media_type)

    _TOKENIZE = {"type": "object", "properties": {"prompt": {"type": "string"}}}
    _DETOKENIZE = {
        "type": "object",
        "properties": {"tokens": {"type": "array", "items": {"type": "integer"}}},
    }

    @r.post("/tokenize", **route_doc(_TOKENIZE, 413, 503, relayed=(400, 404)))
    async def tokenize(request: Request) -> Response:
        return relayed(await front.tokenize(await read_object(request)))

    @r.post("/detokenize", **route_doc(_DETOKENIZE, 413, 503, relayed=(400, 404)))
    async def detokenize(request: Request) -> Response:
        return relayed(await front.detokenize(await read_object(request)))

    @r.post("/finish_session", **route_doc(None, 400, 503))
    async def finish_session(
        session_id: Annotated[str | None, Query(max_length=512)] = None,
    ) -> dict:
        if not session_id:
            raise InvalidRequest("session_id is required", param="session_id")
        return await front.finish_session(session_id)

    return r
