"""Response bodies of the OpenAI routes, in vLLM 0.32's shapes and key order (plain functions).

Key order is part of the contract: clients and tests compare raw bytes of the SSE stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lorafleet.engine._runtime import GenResult, TokenEvent

__all__ = [
    "chat_body",
    "chat_chunk",
    "chat_logprobs",
    "chat_usage_chunk",
    "completion_body",
    "completion_choice",
    "completion_chunk",
    "completion_usage_chunk",
    "finish",
    "legacy_logprobs",
    "model_card",
    "token_namer",
    "usage",
]

TokenText = Callable[[int], str]


def usage(result: GenResult) -> dict:
    """The ``usage`` object of one generation."""
    n = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "total_tokens": result.prompt_tokens + n,
        "completion_tokens": n,
        "prompt_tokens_details": None,
    }


def finish(result: GenResult) -> str:
    """OpenAI's ``finish_reason``: an aborted generation reports "stop", as vLLM's does."""
    return "length" if result.finish_reason == "length" else "stop"


def token_namer(token_text: TokenText, as_ids: bool | None) -> TokenText:
    """How logprobs name a token: its text, or (``return_tokens_as_token_ids``, as vLLM's)
    ``"token_id:<id>"``, which offsets then count as vLLM's do."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else token_text


def legacy_logprobs(
    token_text: TokenText,
    events: Iterable[TokenEvent],
    offset: int,
    prompt: GenResult | None = None,
    prompt_ids: list[int] | None = None,
    top_k: int = 0,
) -> dict:
    """The completions API's logprobs: parallel lists, text offsets counted from ``offset``.

    ``prompt``: the result whose prompt (``prompt_ids``) was echoed and scored, listed first as
    vLLM does (the first token has no logprob; then the token and the ``top_k`` likeliest
    there), with offsets from 0.
    """
    lp: dict[str, list] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    if prompt is not None and prompt.prompt_logprobs is not None and prompt_ids is not None:
        at = 0
        scores = prompt.prompt_top or [None] * len(prompt_ids)
        for tid, value, score in zip(prompt_ids, prompt.prompt_logprobs, scores, strict=True):
            text = token_text(tid)
            lp["text_offset"].append(at)
            at += len(text)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(value)
            if value is None:
                lp["top_logprobs"].append(None)
                continue
            # The same k as the generated tokens' (the prompt may have been scored deeper).
            top = {token_text(i): v for i, v in score.top[:top_k]} if score is not None else {}
            top.setdefault(text, value)
            lp["top_logprobs"].append(top)
    for ev in events:
        if ev.token_id < 0:
            continue
        text = token_text(ev.token_id)
        lp["text_offset"].append(offset)
        offset += len(text)
        lp["tokens"].append(text)
        lp["token_logprobs"].append(ev.logprob)
        top = {token_text(i): v for i, v in ev.top or []}
        top.setdefault(text, ev.logprob)
        lp["top_logprobs"].append(top)
    return lp


def prompt_logprobs(
    token_text: TokenText, ids: list[int], result: GenResult, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first token, then for each position
    the prompt's own token and the k likeliest there, by id, with logprob, rank and text."""
    assert result.prompt_logprobs is not None and result.prompt_top is not None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for pos in range(1, len(ids)):
        score = result.prompt_top[pos]
        assert score is not None
        entries = {
            str(tid): {"logprob": v, "rank": r + 1, "decoded_token": token_text(tid)}
            for r, (tid, v) in enumerate(score.top if k < 0 else score.top[:k])
        }
        own = str(ids[pos])
        entries.setdefault(
            own,
            {
                "logprob": result.prompt_logprobs[pos],
                "rank": score.rank,
                "decoded_token": token_text(ids[pos]),
            },
        )
        # vLLM lists the prompt's own token first.
        out.append({own: entries[own], **{k: v for k, v in entries.items() if k != own}})
    return out


def chat_logprobs(token_text: TokenText, events: Iterable[TokenEvent]) -> dict:
    """The chat API's logprobs: one entry per token, with its bytes and its top alternatives."""
    content = []
    for ev in events:
        if ev.token_id < 0:
            continue
        text = token_text(ev.token_id)
        content.append(
            {
                "token": text,
                "logprob": ev.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": token_text(i),
                        "logprob": v,
                        "bytes": list(token_text(i).encode()),
                    }
                    for i, v in ev.top or []
                ],
            }
        )
    return {"content": content}


def model_card(id_: str, root: str, parent: str | None, created: int, max_len: int | None) -> dict:
    """One entry of ``GET /v1/models``: the base model, or an adapter with its path as root."""
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


# --- /v1/completions -----------------------------------------------------------------------------


def completion_choice(
    index: int,
    text: str,
    logprobs: dict | None,
    result: GenResult,
    token_ids: tuple[list[int], list[int]] | None = None,
) -> dict:
    """One choice of a whole completion; ``token_ids``: (prompt ids, generated ids) if asked."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish(result),
        "stop_reason": result.stop_reason,
        "prompt_logprobs": None,
    }
    if token_ids is not None:
        choice["prompt_token_ids"], choice["token_ids"] = token_ids
    return choice


def completion_body(cid: str, created: int, model: str, choices: list[dict], total: dict) -> dict:
    """A whole completion; ``total`` sums the usage of every choice."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {**total, "prompt_tokens_details": None},
    }


def completion_chunk(
    cid: str, created: int, model: str, index: int, text: str, **extra: Any
) -> dict:
    """One streamed completion chunk; ``extra`` overrides or adds choice fields."""
    c = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    c["stop_reason"] = None
    c.update(extra)
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [c],
    }


def completion_usage_chunk(cid: str, created: int, model: str, total: dict) -> dict:
    """The last chunk of a completion stream with ``include_usage``: no choices, the usage."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": total,
    }


# --- /v1/chat/completions ------------------------------------------------------------------------


def chat_body(
    cid: str,
    created: int,
    model: str,
    result: GenResult,
    logprobs: dict | None,
    token_ids: tuple[list[int], list[int]] | None = None,
) -> dict:
    """A whole chat completion; ``token_ids``: (prompt ids, generated ids) if asked."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": result.text,
            "refusal": None,
            "tool_calls": [],
        },
        "logprobs": logprobs,
        "finish_reason": finish(result),
        "stop_reason": result.stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids[1]
    body: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(result),
    }
    if token_ids is not None:
        body["prompt_token_ids"] = token_ids[0]
    return body


def chat_chunk(cid: str, created: int, model: str, delta: dict, **extra: Any) -> dict:
    """One streamed chat chunk; ``extra`` overrides or adds choice fields."""
    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    c.update(extra)
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [c],
    }


def chat_usage_chunk(cid: str, created: int, model: str, result: GenResult) -> dict:
    """The chunk after the final one of a chat stream with ``include_usage``."""
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(result),
    }
