"""The reference engine's HTTP surface: OpenAI routes, runtime LoRA in vLLM's and SGLang's dialects.

``create_app(runtime)`` builds the FastAPI app. Route handlers only translate HTTP to runtime calls
and back; model work happens on the runtime's worker thread, never on the event loop.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafleet._auth import check_bearer
from lorafleet.engine._errors import EngineError, error_body
from lorafleet.engine._runtime import AdapterRecord, GenParams, GenResult, Runtime, TokenEvent
from lorafleet.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    LoadLoRAAdapterRequest,
    SGLangLoadLoRAAdapterRequest,
    SGLangUnloadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)

__all__ = ["create_app"]

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lorafleet_engine_requests",
            "Requests by route and requested model.",
            ["route", "model"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "lorafleet_engine_generation_tokens",
            "Generated tokens by model.",
            ["model"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "lorafleet_engine_prompt_tokens",
            "Prompt tokens by model.",
            ["model"],
            registry=self.registry,
        )
        self.adapters_loaded = Gauge(
            "lorafleet_engine_adapters_loaded",
            "LoRA adapters currently registered.",
            registry=self.registry,
        )


def create_app(runtime: Runtime, *, api_key: str | None = None) -> FastAPI:
    """The engine's ASGI app. ``api_key`` guards /v1/* and SGLang's routes like vLLM's --api-key."""
    app = FastAPI(title="lorafleet reference engine", docs_url=None, redoc_url=None)
    metrics = _Metrics()
    served = runtime.served_model_name

    # --- errors: vLLM's envelope everywhere ---------------------------------------------------

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return JSONResponse(
            error_body(400, "BadRequestError", "; ".join(parts) or "invalid request"),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return JSONResponse(
            error_body(exc.status_code, kind, str(exc.detail)), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, "InternalServerError", str(exc)), status_code=500)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        path = request.url.path
        guarded = path.startswith("/v1") or path in (
            "/generate",
            "/load_lora_adapter",
            "/unload_lora_adapter",
        )
        if (
            api_key is not None
            and guarded
            and request.method != "OPTIONS"
            and check_bearer(request.headers.get("authorization"), api_key) != "ok"
        ):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    # --- helpers ------------------------------------------------------------------------------

    def resolve(model: str | None, lora_path: str | None = None) -> AdapterRecord | None:
        if lora_path:  # SGLang's OpenAI routes: adapter in the body
            return runtime.resolve(lora_path)
        if model and ":" in model and model not in runtime.adapters:
            base, _, adapter = model.partition(":")  # SGLang's "<base>:<adapter>"
            if base == served and adapter in runtime.adapters:
                return runtime.adapters[adapter]
        return runtime.resolve(model)

    def budget(prompt_len: int, requested: int | None) -> int:
        room = runtime.max_model_len - prompt_len
        if requested is None:
            if room <= 0:
                raise EngineError.bad_request(
                    f"The prompt ({prompt_len} tokens) is longer than the maximum model length "
                    f"of {runtime.max_model_len}.",
                    param="prompt",
                )
            return room
        if prompt_len + requested > runtime.max_model_len:
            raise EngineError.bad_request(
                f"This model's maximum context length is {runtime.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"messages, {requested} in the completion). Please reduce the length of the "
                "messages or completion.",
                param="max_tokens",
            )
        return requested

    def check_ids(ids: list[int]) -> list[int]:
        vocab = runtime.model.config.vocab_size
        if not ids:
            raise EngineError.bad_request("The prompt cannot be empty.", param="prompt")
        bad = [i for i in ids if i < 0 or i >= vocab]
        if bad:
            raise EngineError.bad_request(f"Token id {bad[0]} is out of vocabulary", "prompt")
        return ids

    def account(route: str, model: str, result: GenResult) -> None:
        metrics.prompt_tokens.labels(model).inc(result.prompt_tokens)
        metrics.generation_tokens.labels(model).inc(len(result.token_ids))

    def usage(result: GenResult) -> dict:
        n = len(result.token_ids)
        return {
            "prompt_tokens": result.prompt_tokens,
            "total_tokens": result.prompt_tokens + n,
            "completion_tokens": n,
            "prompt_tokens_details": None,
        }

    async def run(
        ids: list[int], adapter: AdapterRecord | None, params: GenParams
    ) -> tuple[list[TokenEvent], GenResult]:
        events: list[TokenEvent] = []
        result: GenResult | None = None
        async for item in runtime.stream(ids, adapter, params):
            if isinstance(item, GenResult):
                result = item
            else:
                events.append(item)
        assert result is not None
        return events, result

    def legacy_logprobs(events: list[TokenEvent], offset: int) -> dict:
        lp: dict[str, list] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        for ev in events:
            if ev.token_id < 0:
                continue
            text = runtime.token_text(ev.token_id)
            lp["text_offset"].append(offset)
            offset += len(text)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(ev.logprob)
            top = {runtime.token_text(i): v for i, v in ev.top or []}
            top.setdefault(text, ev.logprob)
            lp["top_logprobs"].append(top)
        return lp

    def chat_logprobs(events: list[TokenEvent]) -> dict:
        content = []
        for ev in events:
            if ev.token_id < 0:
                continue
            text = runtime.token_text(ev.token_id)
            content.append(
                {
                    "token": text,
                    "logprob": ev.logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": runtime.token_text(i),
                            "logprob": v,
                            "bytes": list(runtime.token_text(i).encode()),
                        }
                        for i, v in ev.top or []
                    ],
                }
            )
        return {"content": content}

    def finish(result: GenResult) -> str:
        return "length" if result.finish_reason == "length" else "stop"

    # --- OpenAI routes ------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.adapters_loaded.set(len(runtime.adapters))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        metrics.requests.labels("/v1/models", "").inc()
        now = int(time.time())

        def card(id_: str, root: str, parent: str | None, created: int, max_len: int | None):
            return {
                "id": id_,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [],
            }

        data = [card(served, runtime.model_dir, None, now, runtime.max_model_len)]
        data += [
            card(a.name, a.path, served, int(a.created), None) for a in runtime.adapters.values()
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/engine_info")
    async def engine_info() -> dict:
        return {
            "model": served,
            "max_loras": runtime.max_loras,
            "max_lora_rank": runtime.max_lora_rank,
            "max_model_len": runtime.max_model_len,
            "adapters": {a.name: a.path for a in runtime.adapters.values()},
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        model_name = req.model or served
        metrics.requests.labels("/v1/completions", model_name).inc()
        adapter = resolve(req.model, req.lora_path)
        p = req.prompt
        if isinstance(p, str):
            prompts: list[tuple[str | None, list[int]]] = [(p, runtime.encode(p))]
        elif p and isinstance(p[0], int):
            prompts = [(None, list(p))]  # type: ignore[arg-type]
        else:
            prompts = [
                (x, runtime.encode(x)) if isinstance(x, str) else (None, list(x))
                for x in p  # type: ignore[union-attr]
            ]
        if not prompts:
            raise EngineError.bad_request("The prompt cannot be empty.", param="prompt")
        for _, ids in prompts:
            check_ids(ids)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params_for = [
            GenParams(
                max_tokens=budget(len(ids), max_tokens),
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
                stop=_stops(req.stop),
                logprobs=req.logprobs,
                ignore_eos=bool(req.ignore_eos),
            )
            for _, ids in prompts
        ]
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def prefix(i: int) -> str:
            text, ids = prompts[i]
            if not req.echo:
                return ""
            return text if text is not None else runtime.tokenizer.decode(ids)

        if not req.stream:
            choices, total = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            for i, (_, ids) in enumerate(prompts):
                events, result = await run(ids, adapter, params_for[i])
                account("/v1/completions", model_name, result)
                choice: dict[str, Any] = {
                    "index": i,
                    "text": prefix(i) + result.text,
                    "logprobs": legacy_logprobs(events, len(prefix(i)))
                    if req.logprobs is not None
                    else None,
                    "finish_reason": finish(result),
                    "stop_reason": result.stop_reason,
                    "prompt_logprobs": None,
                }
                if req.return_token_ids:
                    choice["prompt_token_ids"] = ids
                    choice["token_ids"] = result.token_ids
                choices.append(choice)
                u = usage(result)
                for k in total:
                    total[k] += u[k]
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": {**total, "prompt_tokens_details": None},
            }

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def sse() -> AsyncIterator[str]:
            total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}

            def chunk(i: int, text: str, **extra: Any) -> str:
                c = {"index": i, "text": text, "logprobs": None, "finish_reason": None}
                c["stop_reason"] = None
                c.update(extra)
                return _sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [c],
                    }
                )

            try:
                for i, (_, ids) in enumerate(prompts):
                    offset = len(prefix(i))
                    if req.echo:
                        yield chunk(i, prefix(i))
                    async for item in runtime.stream(ids, adapter, params_for[i]):
                        if isinstance(item, GenResult):
                            account("/v1/completions", model_name, item)
                            extra = {}
                            if req.return_token_ids:
                                extra["prompt_token_ids"] = ids
                            yield chunk(
                                i,
                                "",
                                finish_reason=finish(item),
                                stop_reason=item.stop_reason,
                                **extra,
                            )
                            for k, v in usage(item).items():
                                if k in total:
                                    total[k] += v
                            continue
                        lp = None
                        if req.logprobs is not None and item.token_id >= 0:
                            lp = legacy_logprobs([item], offset)
                            offset += len(runtime.token_text(item.token_id))
                        if not item.text and lp is None:
                            continue
                        extra = {"token_ids": [item.token_id]} if req.return_token_ids else {}
                        yield chunk(i, item.text, logprobs=lp, **extra)
                if include_usage:
                    yield _sse(
                        {
                            "id": cid,
                            "object": "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": total,
                        }
                    )
            except EngineError as exc:
                yield _sse(exc.body())
            yield _DONE

        return StreamingResponse(sse(), media_type="text/event-stream", headers=_SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        model_name = req.model or served
        metrics.requests.labels("/v1/chat/completions", model_name).inc()
        adapter = resolve(req.model, req.lora_path)
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(
                    part.get("text", "") for part in content if part.get("type") == "text"
                )
            messages.append({"role": m.role, "content": content or ""})
        try:
            prompt = runtime.render_chat(messages, req.add_generation_prompt)
        except Exception as exc:  # jinja errors: vLLM answers 400
            raise EngineError.bad_request(f"chat template failed: {exc}") from exc
        ids = check_ids(runtime.encode(prompt, add_special_tokens=False))
        requested = req.max_completion_tokens or req.max_tokens
        top = req.top_logprobs or 0
        params = GenParams(
            max_tokens=budget(len(ids), requested),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=_stops(req.stop),
            logprobs=top if req.logprobs else None,
            ignore_eos=bool(req.ignore_eos),
        )
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        if not req.stream:
            events, result = await run(ids, adapter, params)
            account("/v1/chat/completions", model_name, result)
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": result.text,
                    "refusal": None,
                    "tool_calls": [],
                },
                "logprobs": chat_logprobs(events) if req.logprobs else None,
                "finish_reason": finish(result),
                "stop_reason": result.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = result.token_ids
            body: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [choice],
                "usage": usage(result),
            }
            if req.return_token_ids:
                body["prompt_token_ids"] = ids
            return body

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, **extra: Any) -> str:
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            c.update(extra)
            return _sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [c],
                }
            )

        async def sse() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for item in runtime.stream(ids, adapter, params):
                    if isinstance(item, GenResult):
                        account("/v1/chat/completions", model_name, item)
                        yield chunk({}, finish_reason=finish(item), stop_reason=item.stop_reason)
                        if include_usage:
                            yield _sse(
                                {
                                    "id": cid,
                                    "object": "chat.completion.chunk",
                                    "created": created,
                                    "model": model_name,
                                    "choices": [],
                                    "usage": usage(item),
                                }
                            )
                        continue
                    lp = chat_logprobs([item]) if req.logprobs and item.token_id >= 0 else None
                    if not item.text and lp is None:
                        continue
                    yield chunk({"content": item.text}, logprobs=lp)
            except EngineError as exc:
                yield _sse(exc.body())
            yield _DONE

        return StreamingResponse(sse(), media_type="text/event-stream", headers=_SSE_HEADERS)

    # --- runtime LoRA, vLLM dialect -----------------------------------------------------------

    @app.post("/v1/load_lora_adapter")
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
            await runtime.load_adapter(name, req.lora_path, replace=True)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
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

    # --- SGLang dialect -----------------------------------------------------------------------

    def sglang_result(success: bool, error: str | None = None) -> JSONResponse:
        body = {
            "success": success,
            "error_message": error,
            "loaded_adapters": {a.name: a.path for a in runtime.adapters.values()},
        }
        return JSONResponse(body, status_code=200 if success else 400)

    @app.post("/load_lora_adapter")
    async def sglang_load(req: SGLangLoadLoRAAdapterRequest) -> JSONResponse:
        metrics.requests.labels("/load_lora_adapter", req.lora_name).inc()
        name = req.lora_name
        async with runtime.admin_lock:
            if name in runtime.adapters and not req.upsert:
                return sglang_result(
                    False, f"Failed to load LoRA adapter {name} because it is already loaded"
                )
            if name == served:
                return sglang_result(
                    False, f"LoRA adapter name {name} conflicts with the base model name."
                )
            try:
                await runtime.load_adapter(name, req.lora_path, replace=True)
            except EngineError as exc:
                return sglang_result(False, f"Failed to load LoRA adapter {name}: {exc.message}")
        return sglang_result(True)

    @app.post("/unload_lora_adapter")
    async def sglang_unload(req: SGLangUnloadLoRAAdapterRequest) -> JSONResponse:
        metrics.requests.labels("/unload_lora_adapter", req.lora_name).inc()
        async with runtime.admin_lock:
            if req.lora_name not in runtime.adapters:
                return sglang_result(False, f"LoRA with name {req.lora_name} does not exist")
            await runtime.unload_adapter(req.lora_name)
        return sglang_result(True)

    @app.get("/get_model_info")
    async def sglang_model_info() -> dict:
        return {
            "model_path": runtime.model_dir,
            "tokenizer_path": runtime.model_dir,
            "is_generation": True,
            "served_model_name": served,
        }

    @app.post("/generate")
    async def sglang_generate(req: GenerateRequest) -> Any:
        def refuse(message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message}}, status_code=400)

        label = req.lora_path or served
        metrics.requests.labels("/generate", label).inc()
        if (req.text is None) == (req.input_ids is None):
            return refuse("Either text or input_ids should be provided.")
        adapter = None
        if req.lora_path:
            adapter = runtime.adapters.get(req.lora_path)
            if adapter is None:
                loaded = ", ".join(sorted(runtime.adapters))
                return refuse(
                    "The following requested LoRA adapters are not loaded: "
                    f"{req.lora_path}\nLoaded adapters: {loaded}"
                )
        ids = runtime.encode(req.text) if req.text is not None else list(req.input_ids or [])
        try:
            check_ids(ids)
            sp = req.sampling_params
            params = GenParams(
                max_tokens=budget(len(ids), sp.max_new_tokens),
                temperature=1.0 if sp.temperature is None else sp.temperature,
                top_p=1.0 if sp.top_p is None else sp.top_p,
                seed=sp.sampling_seed,
                stop=_stops(sp.stop),
                ignore_eos=sp.ignore_eos,
            )
        except EngineError as exc:
            return refuse(exc.message)
        rid = req.rid or uuid.uuid4().hex
        started = time.monotonic()

        def body(text: str, out_ids: list[int], result: GenResult | None) -> dict:
            fr: dict[str, Any] | None = None
            if result is not None:
                if result.finish_reason == "length":
                    fr = {"type": "length", "length": len(result.token_ids)}
                elif result.finish_reason == "abort":
                    fr = {"type": "abort", "message": "aborted"}
                else:
                    matched = result.stop_reason
                    fr = {"type": "stop", "matched": matched if matched else result.token_ids[-1]}
            return {
                "text": text,
                "output_ids": out_ids,
                "meta_info": {
                    "id": rid,
                    "finish_reason": fr,
                    "prompt_tokens": len(ids),
                    "weight_version": "default",
                    "completion_tokens": len(out_ids),
                    "cached_tokens": 0,
                    "e2e_latency": time.monotonic() - started,
                },
            }

        if not req.stream:
            _, result = await run(ids, adapter, params)
            account("/generate", label, result)
            return body(result.text, result.token_ids, result)

        async def sse() -> AsyncIterator[str]:
            text, out_ids = "", []
            async for item in runtime.stream(ids, adapter, params):
                if isinstance(item, GenResult):
                    account("/generate", label, item)
                    yield _sse(body(item.text, item.token_ids, item))
                    continue
                text += item.text
                if item.token_id >= 0:
                    out_ids.append(item.token_id)
                # SGLang streams cumulative text and ids by default (stream_output off).
                yield _sse(body(text, list(out_ids), None))
            yield _DONE

        return StreamingResponse(sse(), media_type="text/event-stream", headers=_SSE_HEADERS)

    app.state.runtime = runtime
    app.state.metrics = metrics
    return app
