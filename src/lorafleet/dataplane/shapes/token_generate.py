"""lorafleet's own ``POST /generate``: ``{"model", "token_ids", "sampling_params"}`` in.

It maps to the engine's ``/v1/completions`` with a token-id prompt and ``return_token_ids``, and
answers ``{"model", "choices": [{"index", "token_ids", "text", "finish_reason", "logprobs"}]}``.
A body with ``text`` or ``input_ids`` is SGLang's shape instead (``sglang.py``).
"""

from __future__ import annotations

import json
from typing import Any

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.shapes.base import Call, ForwardShape, Upstream, parse
from lorafleet.engine_kinds import address, model_field
from lorafleet.errors import InvalidRequest
from lorafleet.protocol.generation import TokenGenerateRequest, is_native_generate

__all__ = ["TokenGenerate", "from_completion"]


class TokenGenerate(ForwardShape):
    path = "/generate"
    summary = "lorafleet's token-id generation: {model, token_ids, sampling_params} (no stream)"
    model = TokenGenerateRequest

    def accepts(self, doc: dict[str, Any]) -> bool:
        return not is_native_generate(doc)

    def prepare(self, call: Call) -> dict[str, Any]:
        req = parse(TokenGenerateRequest, call.doc)
        assert isinstance(req, TokenGenerateRequest)
        if req.stream:
            raise InvalidRequest("/generate does not stream", param="stream")
        return call.doc

    def upstream(self, call: Call, doc: dict[str, Any], route: Route, replica: Replica) -> Upstream:
        body = {**(doc.get("sampling_params") or {}), "prompt": doc["token_ids"]}
        body["return_token_ids"] = True
        if route.alias is not None:
            body["model"] = route.alias
        body = address(body, replica.kind, replica.base_model, route.engine_name)
        sent_model = model_field(replica.kind, replica.base_model, route.engine_name)
        data = json.dumps(body).encode()
        return Upstream("/v1/completions", data, sent_model, from_completion)


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
