"""The OpenAI-compatible routes, as vLLM serves them: models, completions, chat, streaming.

Handlers translate HTTP to runtime calls and back; bodies come from ``_openai_bodies``. The adapter
is named vLLM's way (``model=<adapter>``) or SGLang's (see ``_sglang.openai_adapter_name``); with
an ``_sglang.SGLangDialect`` only SGLang's, exactly as real SGLang names it (a bare name is the
base model), and ``/v1/models`` lists SGLang's cards.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from lorafleet._service import streamed_ok
from lorafleet.engine import _openai_bodies as bodies
from lorafleet.engine import _sglang
from lorafleet.engine._errors import EngineError, responses, stream_error
from lorafleet.engine._generation import (
    budget,
    check_ids,
    check_logprobs,
    check_prompt_logprobs,
    collect,
    stops,
)
from lorafleet.engine._metrics import EngineMetrics
from lorafleet.engine._runtime import AdapterRecord, GenParams, GenResult, Runtime
from lorafleet.engine._sse import DONE, event, streaming_response
from lorafleet.protocol.generation import ChatCompletionRequest, CompletionRequest, openai_beyond

__all__ = ["router"]

log = logging.getLogger("lorafleet.engine")

_STREAMED = streamed_ok("The answer (JSON), or server-sent events when ``stream`` is true")


async def _resolve(
    runtime: Runtime,
    dialect: _sglang.SGLangDialect | None,
    model: str | None,
    lora_path: str | None,
) -> AdapterRecord | None:
    """The adapter a request names: SGLang's way only with ``dialect``; else in SGLang's
    addressing first, then vLLM's (404 if unknown)."""
    if dialect is not None:
        return await dialect.resolve_openai(model, lora_path)
    return runtime.resolve(_sglang.openai_adapter_name(runtime, model, lora_path) or model)


def _refuse_unhonoured(req: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's sampling fields this engine does not implement: a 400 naming the first one that
    asks something, never an answer that ignored it."""
    for name, value in openai_beyond(req.model_extra or {}):
        raise EngineError.bad_request(
            f"{name}={value!r} is not supported by the reference engine", param=name
        )


def _seed(seed: int | None, j: int) -> int | None:
    """Choice ``j``'s seed: reproducible, and different from its siblings'."""
    return None if seed is None else seed + j


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            texts = [part.get("text", "") for part in content if part.get("type") == "text"]
            if not all(isinstance(t, str) for t in texts):
                raise EngineError.bad_request("a text content part needs a string 'text'")
            content = "".join(texts)
        messages.append({"role": m.role, "content": content or ""})
    return messages


def router(
    runtime: Runtime, metrics: EngineMetrics, dialect: _sglang.SGLangDialect | None = None
) -> APIRouter:
    """``/v1/models``, ``/v1/engine_info`` (not with ``dialect``: SGLang has none),
    ``/v1/completions`` and ``/v1/chat/completions``."""
    api = APIRouter()
    served = runtime.served_model_name
    token_text = runtime.token_text

    @api.get("/v1/models")
    async def models() -> dict:
        metrics.requests.labels("/v1/models", "").inc()
        if dialect is not None:
            return dialect.models()
        now = int(time.time())
        data = [bodies.model_card(served, runtime.model_dir, None, now, runtime.max_model_len)]
        data += [
            bodies.model_card(a.name, a.path, served, int(a.created), None)
            for a in runtime.adapters.values()
        ]
        return {"object": "list", "data": data}

    async def engine_info() -> dict:
        return {
            "model": served,
            "max_loras": runtime.max_loras,
            "max_lora_rank": runtime.max_lora_rank,
            "max_model_len": runtime.max_model_len,
            "adapters": {a.name: a.path for a in runtime.adapters.values()},
        }

    async def tokenize(body: dict[str, Any]) -> dict:
        """vLLM's ``/tokenize`` for a text prompt (SkyRL calls it without a local tokenizer)."""
        metrics.requests.labels("/tokenize", str(body.get("model") or "")).inc()
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise EngineError.bad_request("prompt must be a string", param="prompt")
        special = body.get("add_special_tokens", True) is True
        ids = runtime.encode(prompt, add_special_tokens=special)
        return {
            "count": len(ids),
            "max_model_len": runtime.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    async def detokenize(body: dict[str, Any]) -> dict:
        """vLLM's ``/detokenize``: ``{"tokens"}`` -> ``{"prompt"}``."""
        metrics.requests.labels("/detokenize", str(body.get("model") or "")).inc()
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise EngineError.bad_request("tokens must be a list of token ids", param="tokens")
        if ids:
            check_ids(runtime, ids)
        return {"prompt": runtime.tokenizer.decode(ids)}

    if dialect is None:
        api.add_api_route("/v1/engine_info", engine_info, methods=["GET"])
        api.add_api_route("/tokenize", tokenize, methods=["POST"], responses=responses(400))
        api.add_api_route("/detokenize", detokenize, methods=["POST"], responses=responses(400))

    @api.post("/v1/completions", responses=responses(400, 404, ok=_STREAMED))
    async def completions(req: CompletionRequest) -> Any:
        model_name = req.model or served
        metrics.requests.labels("/v1/completions", model_name).inc()
        adapter = await _resolve(runtime, dialect, req.model, req.lora_path)
        shown = bodies.token_namer(token_text, req.return_tokens_as_token_ids)
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
            check_ids(runtime, ids)
        _refuse_unhonoured(req)
        if req.prompt_logprobs is not None:
            # Accepted with stream=True too, as vLLM does; a stream lists them only when it
            # echoes the prompt.
            check_prompt_logprobs(runtime, req.prompt_logprobs)
        temperature = 1.0 if req.temperature is None else req.temperature
        if req.n > 1 and not temperature:  # greedy: n equal answers, refused as vLLM does
            raise EngineError.bad_request(
                f"n must be 1 when using greedy sampling, got {req.n}.", param="n"
            )
        if not req.stream:  # a stream meets it in its first event (check_logprobs)
            check_logprobs(runtime, req.logprobs)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        scored = None if req.stream else req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            # The echoed prompt is listed with its top logprobs, as the generated tokens are.
            scored = max(scored or 0, req.logprobs)
        n = req.n
        # One GenParams per choice: prompt i's j-th sample is choice i * n + j, as in vLLM.
        params_for = [
            GenParams(
                max_tokens=budget(runtime, len(prompts[c // n][1]), max_tokens),
                temperature=temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                seed=_seed(req.seed, c % n),
                stop=stops(req.stop),
                logprobs=req.logprobs,
                ignore_eos=bool(req.ignore_eos),
                prompt_logprobs=scored,
            )
            for c in range(len(prompts) * n)
        ]
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def prefix(c: int) -> str:
            text, ids = prompts[c // n]
            if not req.echo:
                return ""
            return text if text is not None else runtime.tokenizer.decode(ids)

        if not req.stream:
            choices, total = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            for c, params in enumerate(params_for):
                ids = prompts[c // n][1]
                events, result = await collect(runtime, ids, adapter, params)
                metrics.account(model_name, result)
                logprobs = None
                if req.logprobs is not None:
                    echoed = result if req.echo else None
                    logprobs = bodies.legacy_logprobs(
                        shown,
                        events,
                        len(prefix(c)),
                        echoed,
                        ids if req.echo else None,
                        top_k=req.logprobs,
                    )
                choice = bodies.completion_choice(
                    c,
                    prefix(c) + result.text,
                    logprobs,
                    result,
                    (ids, result.token_ids) if req.return_token_ids else None,
                )
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = bodies.prompt_logprobs(
                        token_text, ids, result, req.prompt_logprobs
                    )
                choices.append(choice)
                u = bodies.usage(result)
                for k in total:
                    total[k] += u[k]
            return bodies.completion_body(cid, created, model_name, choices, total)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(i: int, text: str, **extra: Any) -> str:
            return event(bodies.completion_chunk(cid, created, model_name, i, text, **extra))

        async def frames() -> AsyncIterator[str]:
            total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            try:
                check_logprobs(runtime, req.logprobs)
                for i, params in enumerate(params_for):
                    ids = prompts[i // n][1]
                    offset = len(prefix(i))
                    if req.echo:
                        yield chunk(i, prefix(i))
                    async for item in runtime.stream(ids, adapter, params):
                        if isinstance(item, GenResult):
                            metrics.account(model_name, item)
                            extra = {}
                            if req.return_token_ids:
                                extra["prompt_token_ids"] = ids
                            yield chunk(
                                i,
                                "",
                                finish_reason=bodies.finish(item),
                                stop_reason=item.stop_reason,
                                **extra,
                            )
                            for k, v in bodies.usage(item).items():
                                if k in total:
                                    total[k] += v
                            continue
                        lp = None
                        if req.logprobs is not None and item.token_id >= 0:
                            lp = bodies.legacy_logprobs(shown, [item], offset)
                            offset += len(shown(item.token_id))
                        # A token whose text is not whole yet still has its id to report.
                        if not item.text and lp is None and not req.return_token_ids:
                            continue
                        extra = {"token_ids": [item.token_id]} if req.return_token_ids else {}
                        yield chunk(i, item.text, logprobs=lp, **extra)
                if include_usage:
                    yield event(bodies.completion_usage_chunk(cid, created, model_name, total))
            except Exception as exc:  # after the first byte: an error event, then the end
                log.exception("completion stream failed")
                yield event(stream_error(exc))
            yield DONE

        return streaming_response(frames())

    @api.post("/v1/chat/completions", responses=responses(400, 404, ok=_STREAMED))
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        model_name = req.model or served
        metrics.requests.labels("/v1/chat/completions", model_name).inc()
        adapter = await _resolve(runtime, dialect, req.model, req.lora_path)
        shown = bodies.token_namer(token_text, req.return_tokens_as_token_ids)
        try:
            prompt = runtime.render_chat(_chat_messages(req), req.add_generation_prompt)
        except Exception as exc:  # jinja errors: vLLM answers 400
            raise EngineError.bad_request(f"chat template failed: {exc}") from exc
        ids = check_ids(runtime, runtime.encode(prompt, add_special_tokens=False))
        requested = req.max_completion_tokens or req.max_tokens
        top = req.top_logprobs or 0
        _refuse_unhonoured(req)
        for name, asked in (
            ("n", req.n != 1),
            ("prompt_logprobs", req.prompt_logprobs is not None),
        ):
            if asked:
                raise EngineError.bad_request(
                    f"{name} is not supported by the reference engine's chat completions "
                    "(its /v1/completions honours it)",
                    param=name,
                )
        if req.logprobs and not req.stream:  # a stream meets it in its first event
            check_logprobs(runtime, top)
        params = GenParams(
            max_tokens=budget(runtime, len(ids), requested),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=stops(req.stop),
            logprobs=top if req.logprobs else None,
            ignore_eos=bool(req.ignore_eos),
        )
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        if not req.stream:
            events, result = await collect(runtime, ids, adapter, params)
            metrics.account(model_name, result)
            return bodies.chat_body(
                cid,
                created,
                model_name,
                result,
                bodies.chat_logprobs(shown, events) if req.logprobs else None,
                (ids, result.token_ids) if req.return_token_ids else None,
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, **extra: Any) -> str:
            return event(bodies.chat_chunk(cid, created, model_name, delta, **extra))

        async def frames() -> AsyncIterator[str]:
            if req.logprobs:
                try:
                    check_logprobs(runtime, top)
                except EngineError as exc:  # before the role chunk, as vLLM's stream does
                    yield event(exc.body())
                    yield DONE
                    return
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for item in runtime.stream(ids, adapter, params):
                    if isinstance(item, GenResult):
                        metrics.account(model_name, item)
                        yield chunk(
                            {}, finish_reason=bodies.finish(item), stop_reason=item.stop_reason
                        )
                        if include_usage:
                            yield event(bodies.chat_usage_chunk(cid, created, model_name, item))
                        continue
                    lp = None
                    if req.logprobs and item.token_id >= 0:
                        lp = bodies.chat_logprobs(shown, [item])
                    if not item.text and lp is None:
                        continue
                    yield chunk({"content": item.text}, logprobs=lp)
            except Exception as exc:  # after the first byte: an error event, then the end
                log.exception("chat stream failed")
                yield event(stream_error(exc))
            yield DONE

        return streaming_response(frames())

    return api
