"""lorafleet's own ``POST /generate``: ``{"model", "token_ids", "sampling_params"}`` in.

It maps to the engine's ``/v1/completions`` with a token-id prompt and ``return_token_ids``, and
answers ``{"model", "choices": [{"index", "token_ids", "text", "finish_reason", "logprobs"}]}``.
A body with ``text`` or ``input_ids`` is SGLang's shape instead (``router/native.py``).
"""

from __future__ import annotations

import json

from lorafleet.errors import InvalidRequest
from lorafleet.router.addressing import Route

__all__ = ["as_completion", "from_completion"]


def as_completion(req: dict, route: Route) -> dict:
    """SkyRL's ``{model, token_ids, sampling_params}`` as a token-id completion request."""
    ids = req.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise InvalidRequest("token_ids must be a non-empty int list")
    if req.get("stream"):
        raise InvalidRequest("/generate does not stream")
    sp = req.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise InvalidRequest("sampling_params must be an object")
    body = {**sp, "prompt": ids, "return_token_ids": True}
    if route.alias is not None:
        body["model"] = route.alias
    return body


def from_completion(body: bytes) -> bytes:
    """The engine's completion answer in this route's shape."""
    out = json.loads(body)
    choices = [
        {
            "index": c.get("index", i),
            "token_ids": c.get("token_ids"),
            "text": c.get("text"),
            "finish_reason": c.get("finish_reason"),
            "logprobs": c.get("logprobs"),
        }
        for i, c in enumerate(out.get("choices") or [])
    ]
    return json.dumps({"model": out.get("model"), "choices": choices}).encode()
