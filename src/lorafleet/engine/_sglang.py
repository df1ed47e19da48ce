"""SGLang's dialect: ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/generate``,
``/server_info``, ``/model_info``, ``/ready``, and SGLang's way of naming an adapter on the
OpenAI routes.

Everything SGLang-specific lives here, so the dialect can follow the real server on its own:
request shapes are in ``protocol`` (``SGLang*``, ``GenerateRequest``), the rest below.

Two modes:

- ``lorafleet engine`` (the default, vLLM's dialect): these routes are added to vLLM's, and the
  OpenAI routes also take SGLang's ``<base>:<adapter>`` and ``lora_path`` on top of vLLM's bare
  name. Lenient, as it always was.
- ``lorafleet engine --dialect sglang`` (``SGLangDialect``): the engine behaves as a real SGLang
  0.5.23 server does wherever lorafleet depends on it, observed on one (docs/engines/sglang.md):
  a bare adapter name in ``model`` silently serves the base model; ``<anything>:<adapter>`` or
  ``lora_path`` applies it; an unknown adapter is a 400 in SGLang's words; no upsert (unless the
  Miles fork is imitated); an unloaded or evicted name stays remembered with its path and is
  re-loaded from the files there by the next request naming it; no vLLM routes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from lorafleet._service import streamed_ok
from lorafleet.engine._errors import ERROR_SCHEMA, EngineError, responses
from lorafleet.engine._generation import budget, check_ids, collect, stops
from lorafleet.engine._metrics import EngineMetrics
from lorafleet.engine._runtime import AdapterRecord, GenParams, GenResult, Runtime
from lorafleet.engine._sse import DONE, event, streaming_response
from lorafleet.protocol.front import SGLangLoadLoRAAdapterRequest, SGLangUnloadLoRAAdapterRequest
from lorafleet.protocol.generation import DEFAULT_MAX_NEW_TOKENS, GenerateRequest, keeps_every_token

__all__ = [
    "GUARDED_PATHS",
    "SGLANG_VERSION",
    "SGLangDialect",
    "SGLangError",
    "finish_reason",
    "generate_body",
    "model_info",
    "openai_adapter_name",
    "router",
    "server_info",
    "stream_error_body",
    "update_result",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose behaviour ``--dialect sglang`` copies."""

# SGLang's routes have no /v1 prefix; the API key guards these as well as /v1/*.
GUARDED_PATHS = frozenset(
    {
        "/generate",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
    }
)


class SGLangError(EngineError):
    """An error in SGLang's own shape: ``{"object": "error", "message", "type", "param",
    "code"}`` on the OpenAI routes, ``{"error": {"message"}}`` on ``/generate``."""

    def __init__(self, message: str, *, native: bool = False) -> None:
        super().__init__(400, "BadRequestError", message)
        self.native = native

    def body(self) -> dict:
        if self.native:
            return {"error": {"message": self.message}}
        return {
            "object": "error",
            "message": self.message,
            "type": self.err_type,
            "param": None,
            "code": self.status,
        }


def openai_adapter_name(runtime: Runtime, model: str | None, lora_path: str | None) -> str | None:
    """The adapter an OpenAI request names in SGLang's addressing, or None (vLLM's dialect).

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


def split_model(served: str, model: str | None) -> str | None:
    """The adapter SGLang reads out of ``model``: what follows ``<served>:`` (the served name
    is stripped first, so adapter names may hold a colon), else what follows the first colon;
    the prefix is never checked (``_parse_model_parameter``). None: no adapter named."""
    if not model or ":" not in model or model == served:
        return None
    prefix = f"{served}:"
    adapter = model[len(prefix) :] if model.startswith(prefix) else model.split(":", 1)[1]
    return adapter.strip() or None


def _keys(names: object) -> str:
    """A key list as SGLang prints it: ``dict_keys(['a', 'b'])``."""
    return repr(dict.fromkeys(names).keys())  # type: ignore[call-overload]


class SGLangDialect:
    """The engine as a real SGLang 0.5.23 server: its registry, its remembered names, its rules.

    SGLang keeps two tables: the registry (``runtime.adapters``, what ``/v1/models`` lists) and
    ``remembered``, name -> the path of its last successful load, which nothing ever shrinks
    (``TokenizerManager.lora_ref_cache``). A request naming an adapter that is remembered but not
    registered re-loads it from that path, reading whatever files are there now.
    ``runtime.max_loras`` plays ``--max-loaded-loras``: a load over it unloads the least recently
    used unpinned adapter (which stays remembered).
    """

    def __init__(self, runtime: Runtime, *, upsert: bool = False) -> None:
        self.runtime = runtime
        self.upsert = upsert
        """The Miles fork's ``upsert: true`` replaces a registered name (0.5.23 ignores it)."""
        self.remembered: dict[str, str] = {}
        self.pinned: set[str] = set()
        self.last_used: dict[str, float] = {}

    # --- addressing ---------------------------------------------------------------------------

    async def resolve_openai(
        self, model: str | None, lora_path: str | None
    ) -> AdapterRecord | None:
        """The adapter an OpenAI request applies: ``model``'s suffix wins over ``lora_path``; a
        bare name, known or not, is the base model."""
        name = split_model(self.runtime.served_model_name, model) or lora_path
        return await self.resolve(name) if name else None

    async def resolve(self, name: str, *, native: bool = False) -> AdapterRecord:
        """The registered adapter ``name``, re-loaded from its remembered path if need be.

        Raises ``SGLangError`` (400): never loaded, or the implicit re-load failed.
        """
        rt = self.runtime
        rec = rt.adapters.get(name)
        if rec is None:
            if name not in self.remembered:
                raise SGLangError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {_keys(self.remembered)}.",
                    native=native,
                )
            async with rt.admin_lock:  # behind an unload of the name, as SGLang's update lock
                rec = rt.adapters.get(name)
                if rec is None:
                    error = await self._load(name, self.remembered[name], name in self.pinned)
                    rec = rt.adapters.get(name)
                    if rec is None:
                        raise SGLangError(
                            f"Failed to implicitly load LoRA adapter {name}: {error}",
                            native=native,
                        )
        self.last_used[name] = time.monotonic()
        return rec

    # --- the runtime LoRA API -----------------------------------------------------------------

    async def load(self, name: str, path: str, *, pinned: bool, upsert: bool) -> str | None:
        """``POST /load_lora_adapter``: None on success, else SGLang's error message."""
        async with self.runtime.admin_lock:
            return await self._load(name, path, pinned, replace=upsert and self.upsert)

    async def _load(
        self, name: str, path: str, pinned: bool, *, replace: bool = False
    ) -> str | None:
        rt = self.runtime
        if name in rt.adapters and not replace:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        p = Path(path)
        if not p.exists():
            # A path that is not a directory is taken for a hub repo id (HF_HUB_OFFLINE or not).
            return (
                "Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                f"'{path}'. Use `repo_type` argument if needed."
            )
        if not (p / "adapter_config.json").is_file():
            return f"[Errno 2] No such file or directory: '{p / 'adapter_config.json'}'"
        if name not in rt.adapters and len(rt.adapters) >= rt.max_loras:
            victim = self._least_recently_used()
            if victim is None:
                return (
                    "Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                    f"LoRA registry is: {sorted(rt.adapters)}"
                )
            await self._unload(victim)
        try:
            await rt.load_adapter(name, path, replace=True)
        except EngineError as exc:
            return exc.message
        self.remembered[name] = path
        self.last_used[name] = time.monotonic()
        if pinned:
            self.pinned.add(name)
        else:
            self.pinned.discard(name)
        return None

    def _least_recently_used(self) -> str | None:
        candidates = [n for n in self.runtime.adapters if n not in self.pinned]
        return min(candidates, key=lambda n: self.last_used.get(n, 0.0), default=None)

    async def unload(self, name: str) -> str | None:
        """``POST /unload_lora_adapter``: None on success, else SGLang's error message. Waits
        for the requests already queued with the adapter (the worker runs in arrival order)."""
        async with self.runtime.admin_lock:
            if name not in self.runtime.adapters:
                loaded = repr(OrderedDict.fromkeys(self.runtime.adapters).keys())
                return f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}"
            await self._unload(name)
        return None

    async def _unload(self, name: str) -> None:
        await self.runtime.unload_adapter(name)  # still remembered
        self.last_used.pop(name, None)

    # --- info ---------------------------------------------------------------------------------

    def models(self) -> dict:
        """``GET /v1/models``: the base card, then each registered adapter (root: its path as
        given, parent: the base)."""
        rt = self.runtime
        served = rt.served_model_name
        now = int(time.time())

        def card(id_: str, root: str, parent: str | None, max_len: int | None) -> dict:
            return {
                "id": id_,
                "object": "model",
                "created": now,
                "owned_by": "sglang",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
            }

        data = [card(served, served, None, rt.max_model_len)]
        data += [card(a.name, a.path, served, None) for a in rt.adapters.values()]
        return {"object": "list", "data": data}


# --- bodies --------------------------------------------------------------------------------------


def update_result(
    runtime: Runtime, success: bool, error: str | None = None, *, listed: bool = True
) -> JSONResponse:
    """SGLang's ``LoRAUpdateOutput``: 200 on success, 400 on failure, with the loaded set
    (``listed=False``: null, as SGLang answers a failed unload)."""
    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": error,
        "loaded_adapters": (
            {a.name: a.path for a in runtime.adapters.values()} if listed else None
        ),
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
    """``GET /model_info`` (and the deprecated ``/get_model_info``)."""
    return {
        "model_path": runtime.model_dir,
        "served_model_name": runtime.served_model_name,
        "tokenizer_path": runtime.model_dir,
        "is_generation": True,
        "weight_version": "default",
    }


def server_info(runtime: Runtime, dialect: SGLangDialect | None) -> dict:
    """``GET /server_info``: the launch arguments SGLang reports, the LoRA ones among them."""
    return {
        "version": SGLANG_VERSION,
        "model_path": runtime.model_dir,
        "served_model_name": runtime.served_model_name,
        "enable_lora": True,
        "max_lora_rank": runtime.max_lora_rank,
        # The reference engine's --max-loras: a cap that evicts in the SGLang dialect.
        "max_loaded_loras": runtime.max_loras,
        "max_loras_per_batch": 8,
        "lora_target_modules": list(runtime.lora_modules),
        "lora_backend": "torch_native",
        "lora_eviction_policy": "lru",
        "lora_paths": [],
        "max_total_num_tokens": runtime.max_model_len,
        "skip_server_warmup": True,
        "lorafleet_reference_engine": True,
        "lorafleet_upsert": bool(dialect is None or dialect.upsert),
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


def router(
    runtime: Runtime, metrics: EngineMetrics, dialect: SGLangDialect | None = None
) -> APIRouter:
    """SGLang's runtime-LoRA routes, its native ``/generate`` and its info routes; with
    ``dialect`` they behave as real SGLang 0.5.23, without it as they always did here."""
    api = APIRouter()
    served = runtime.served_model_name

    @api.post("/load_lora_adapter", responses=_UPDATE_RESPONSES)
    async def sglang_load(req: SGLangLoadLoRAAdapterRequest) -> JSONResponse:
        metrics.requests.labels("/load_lora_adapter", req.lora_name).inc()
        name = req.lora_name
        if dialect is not None:
            error = await dialect.load(name, req.lora_path, pinned=req.pinned, upsert=req.upsert)
            return update_result(runtime, error is None, error or "")
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
        if dialect is not None:
            error = await dialect.unload(req.lora_name)
            return update_result(runtime, error is None, error or "", listed=error is None)
        async with runtime.admin_lock:
            if req.lora_name not in runtime.adapters:
                return update_result(
                    runtime, False, f"LoRA with name {req.lora_name} does not exist"
                )
            await runtime.unload_adapter(req.lora_name)
        return update_result(runtime, True)

    @api.get("/model_info")
    @api.get("/get_model_info")
    async def sglang_model_info() -> dict:
        return model_info(runtime)

    @api.get("/server_info")
    @api.get("/get_server_info")
    async def sglang_server_info() -> dict:
        return server_info(runtime, dialect)

    @api.get(
        "/ready",
        response_class=Response,
        responses={200: {"description": "Ready (an empty body, as SGLang's)"}},
    )
    async def ready() -> Response:
        return Response(status_code=200)

    @api.post(
        "/generate",
        responses=responses(
            400,
            ok=streamed_ok("The answer (JSON), or server-sent events when ``stream`` is true"),
        ),
    )
    async def sglang_generate(req: GenerateRequest) -> Any:
        items = req.items()
        if len(items) != 1:
            return _refuse("the reference engine answers one prompt per /generate, not a batch")
        item = items[0]
        lora_path = item.lora_path
        label = lora_path or served
        metrics.requests.labels("/generate", label).inc()
        sp = item.sampling_params
        # Never an answer that ignored what was asked: what this engine does not do is refused.
        refused = [(f"sampling_params.{k}", v) for k, v in sp.beyond({"top_k"})]
        if item.return_logprob:
            refused.append(("return_logprob", True))
        if refused:
            what, value = refused[0]
            return _refuse(f"{what}={value!r} is not supported by the reference engine")
        adapter = None
        if lora_path and dialect is not None:
            try:
                adapter = await dialect.resolve(lora_path, native=True)
            except SGLangError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
        elif lora_path:
            adapter = runtime.adapters.get(lora_path)
            if adapter is None:
                loaded = ", ".join(sorted(runtime.adapters))
                return _refuse(
                    "The following requested LoRA adapters are not loaded: "
                    f"{lora_path}\nLoaded adapters: {loaded}"
                )
        # input_ids win over text, as in SGLang.
        ids = list(item.input_ids) if item.input_ids is not None else runtime.encode(item.text)
        try:
            check_ids(runtime, ids)
            max_new = DEFAULT_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens
            top_k = sp.top_k or 0
            params = GenParams(
                max_tokens=budget(runtime, len(ids), max_new),
                temperature=1.0 if sp.temperature is None else sp.temperature,
                top_p=1.0 if sp.top_p is None else sp.top_p,
                top_k=0 if keeps_every_token(top_k) else top_k,
                seed=sp.sampling_seed,
                stop=stops(sp.stop),
                ignore_eos=bool(sp.ignore_eos),
            )
        except EngineError as exc:
            return _refuse(exc.message)
        rid = item.rid
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
