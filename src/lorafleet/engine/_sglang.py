"""SGLang's dialect: ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/generate``,
``/get_model_info``, and SGLang's way of naming an adapter on the OpenAI routes.

Everything SGLang-specific lives here, so the dialect can follow the real server on its own:
request shapes are in ``protocol`` (``SGLang*``, ``GenerateRequest``), the rest below. Shapes
follow SGLang's ``http_server.py`` and ``io_struct.py`` (research/sglang-and-miles.md §1).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from lorafleet._service import streamed_ok
from lorafleet.engine._errors import ERROR_SCHEMA, EngineError, responses
from lorafleet.engine._generation import budget, check_ids, collect, stops
from lorafleet.engine._metrics import EngineMetrics
from lorafleet.engine._runtime import GenParams, GenResult, Runtime
from lorafleet.engine._sse import DONE, event, streaming_response
from lorafleet.engine.protocol import (
    GenerateRequest,
    SGLangLoadLoRAAdapterRequest,
    SGLangUnloadLoRAAdapterRequest,
)

__all__ = [
    "GUARDED_PATHS",
    "finish_reason",
    "generate_body",
    "model_info",
    "openai_adapter_name",
    "router",
    "stream_error_body",
    "update_result",
]

# SGLang's routes have no /v1 prefix; the API key guards these as well as /v1/*.
GUARDED_PATHS = frozenset({"/generate", "/load_lora_adapter", "/unload_lora_adapter"})


def openai_adapter_name(runtime: Runtime, model: str | None, lora_path: str | None) -> str | None:
    """The adapter an OpenAI request names in SGLang's addressing, or None.

    SGLang takes ``lora_path`` in the body, or ``model="<base>:<adapter>"``. A name that is
    itself a registered adapter, or a base that is not ours, is left to vLLM's addressing.
    """
    if lora_path:
        return lora_path
    if model and ":" in model and model not in runtime.adapters:
        base, _, adapter = model.partition(":")
        if base == runtime.served_model_name and adapter in runtime.adapters:
            return adapter
    return None


# --- bodies --------------------------------------------------------------------------------------


def update_result(runtime: Runtime, success: bool, error: str | None = None) -> JSONResponse:
    """SGLang's ``LoRAUpdateOutput``: 200 on success, 400 on failure, always the loaded set."""
    body = {
        "success": success,
        "error_message": error,
        "loaded_adapters": {a.name: a.path for a in runtime.adapters.values()},
    }
    return JSONResponse(body, status_code=200 if success else 400)


def finish_reason(result: GenResult | None) -> dict[str, Any] | None:
    """``meta_info.finish_reason``: None while streaming, then length, abort or stop."""
    if result is None:
        return None
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.token_ids)}
    if result.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    matched = result.stop_reason
    return {"type": "stop", "matched": matched if matched else result.token_ids[-1]}


def generate_body(
    text: str,
    out_ids: list[int],
    result: GenResult | None,
    *,
    rid: str,
    prompt_tokens: int,
    started: float,
) -> dict:
    """One ``/generate`` answer (or stream frame): text, ids and ``meta_info``."""
    return {
        "text": text,
        "output_ids": out_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": finish_reason(result),
            "prompt_tokens": prompt_tokens,
            "weight_version": "default",
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - started,
        },
    }


def model_info(runtime: Runtime) -> dict:
    """``GET /get_model_info``."""
    return {
        "model_path": runtime.model_dir,
        "tokenizer_path": runtime.model_dir,
        "is_generation": True,
        "served_model_name": runtime.served_model_name,
    }


def stream_error_body(exc: BaseException) -> dict:
    """The error event SGLang's ``/generate`` stream ends with (``stream_results``)."""
    code = 400 if isinstance(exc, ValueError) else getattr(exc, "status", 500)
    return {
        "error": {
            "message": str(exc),
            "type": "invalid_request_error",
            "code": code,
            "retryable": False,
        }
    }


def _refuse(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=400)


# --- routes --------------------------------------------------------------------------------------

_UPDATE = {
    "type": "object",
    "required": ["success", "loaded_adapters"],
    "properties": {
        "success": {"type": "boolean"},
        "error_message": {"type": ["string", "null"]},
        "loaded_adapters": {"type": "object"},
    },
}
# SGLang's LoRAUpdateOutput: 200 on success, 400 on failure; or a malformed body's 400.
_UPDATE_RESPONSES: dict[int | str, dict] = {
    200: {"description": "Loaded", "content": {"application/json": {"schema": _UPDATE}}},
    400: {
        "description": "Refused (success false), or a malformed body",
        "content": {"application/json": {"schema": {"anyOf": [_UPDATE, ERROR_SCHEMA]}}},
    },
}


def router(runtime: Runtime, metrics: EngineMetrics) -> APIRouter:
    """SGLang's runtime-LoRA routes, its native ``/generate`` and ``/get_model_info``."""
    api = APIRouter()
    served = runtime.served_model_name

    @api.post("/load_lora_adapter", responses=_UPDATE_RESPONSES)
    async def sglang_load(req: SGLangLoadLoRAAdapterRequest) -> JSONResponse:
        metrics.requests.labels("/load_lora_adapter", req.lora_name).inc()
        name = req.lora_name
        async with runtime.admin_lock:
            if name in runtime.adapters and not req.upsert:
                return update_result(
                    runtime,
                    False,
                    f"Failed to load LoRA adapter {name} because it is already loaded",
                )
            if name == served:
                return update_result(
                    runtime, False, f"LoRA adapter name {name} conflicts with the base model name."
                )
            try:
                await runtime.load_adapter(name, req.lora_path, replace=True)
            except EngineError as exc:
                return update_result(
                    runtime, False, f"Failed to load LoRA adapter {name}: {exc.message}"
                )
        return update_result(runtime, True)

    @api.post("/unload_lora_adapter", responses=_UPDATE_RESPONSES)
    async def sglang_unload(req: SGLangUnloadLoRAAdapterRequest) -> JSONResponse:
        metrics.requests.labels("/unload_lora_adapter", req.lora_name).inc()
        async with runtime.admin_lock:
            if req.lora_name not in runtime.adapters:
                return update_result(
                    runtime, False, f"LoRA with name {req.lora_name} does not exist"
                )
            await runtime.unload_adapter(req.lora_name)
        return update_result(runtime, True)

    @api.get("/get_model_info")
    async def sglang_model_info() -> dict:
        return model_info(runtime)

    @api.post(
        "/generate",
        responses=responses(
            400,
            ok=streamed_ok("The answer (JSON), or server-sent events when ``stream`` is true"),
        ),
    )
    async def sglang_generate(req: GenerateRequest) -> Any:
        label = req.lora_path or served
        metrics.requests.labels("/generate", label).inc()
        if (req.text is None) == (req.input_ids is None):
            return _refuse("Either text or input_ids should be provided.")
        adapter = None
        if req.lora_path:
            adapter = runtime.adapters.get(req.lora_path)
            if adapter is None:
                loaded = ", ".join(sorted(runtime.adapters))
                return _refuse(
                    "The following requested LoRA adapters are not loaded: "
                    f"{req.lora_path}\nLoaded adapters: {loaded}"
                )
        ids = runtime.encode(req.text) if req.text is not None else list(req.input_ids or [])
        try:
            check_ids(runtime, ids)
            sp = req.sampling_params
            params = GenParams(
                max_tokens=budget(runtime, len(ids), sp.max_new_tokens),
                temperature=1.0 if sp.temperature is None else sp.temperature,
                top_p=1.0 if sp.top_p is None else sp.top_p,
                seed=sp.sampling_seed,
                stop=stops(sp.stop),
                ignore_eos=sp.ignore_eos,
            )
        except EngineError as exc:
            return _refuse(exc.message)
        rid = req.rid or uuid.uuid4().hex
        started = time.monotonic()

        def body(text: str, out_ids: list[int], result: GenResult | None) -> dict:
            return generate_body(
                text, out_ids, result, rid=rid, prompt_tokens=len(ids), started=started
            )

        if not req.stream:
            _, result = await collect(runtime, ids, adapter, params)
            metrics.account(label, result)
            return body(result.text, result.token_ids, result)

        async def frames() -> AsyncIterator[str]:
            text, out_ids = "", []
            try:
                async for item in runtime.stream(ids, adapter, params):
                    if isinstance(item, GenResult):
                        metrics.account(label, item)
                        yield event(body(item.text, item.token_ids, item))
                        continue
                    text += item.text
                    if item.token_id >= 0:
                        out_ids.append(item.token_id)
                    # SGLang streams cumulative text and ids by default (stream_output off).
                    yield event(body(text, list(out_ids), None))
            except Exception as exc:  # SGLang's stream_results: an error event, then the end
                yield event(stream_error_body(exc))
            yield DONE

        return streaming_response(frames())

    return api
