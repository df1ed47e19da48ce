"""OpenAI's completions and chat completions: the client's body, addressed per replica.

The version's engine name goes in ``model`` the way the replica's engine kind names an adapter
(``lorafleet.engine_kinds.address``); a base-model request the data plane has nothing to change
in goes out as the client's own bytes. The answer is relayed, tagged (``relay.py``).
"""

from __future__ import annotations

import json
from typing import Any

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.shapes.base import Call, ForwardShape, Upstream
from lorafleet.dataplane.tagging import MODEL_RE, esc
from lorafleet.engine_kinds import address, model_field
from lorafleet.protocol.generation import ChatCompletionRequest, CompletionRequest

__all__ = ["ChatCompletions", "Completions"]


class Completions(ForwardShape):
    path = "/v1/completions"
    summary = "OpenAI completions, routed by adapter version (stream or not)"
    model = CompletionRequest
    streams = True

    def upstream(self, call: Call, doc: dict[str, Any], route: Route, replica: Replica) -> Upstream:
        sent_model = model_field(replica.kind, replica.base_model, route.engine_name)
        if "lora_path" not in doc:
            if route.engine_name is None:
                return Upstream(self.path, call.body, sent_model)
            spliced = _spliced(call.body, doc.get("model"), sent_model)
            if spliced is not None:
                return Upstream(self.path, spliced, sent_model)
        body = address(doc, replica.kind, replica.base_model, route.engine_name)
        return Upstream(self.path, json.dumps(body).encode(), sent_model)


class ChatCompletions(Completions):
    path = "/v1/chat/completions"
    summary = "OpenAI chat completions, routed by adapter version (stream or not)"
    model = ChatCompletionRequest


def _spliced(body: bytes, model: object, sent_model: str | None) -> bytes | None:
    """The client's own bytes with ``model`` replaced by the engine's name for it, when the body
    names a model exactly once (so the match is the top-level key) as the client wrote it; None:
    re-encode instead. A body the data plane only forwards is not parsed back into JSON text."""
    if not isinstance(model, str) or sent_model is None or body.count(b'"model"') != 1:
        return None
    m = MODEL_RE.search(body)
    if m is None or m.group(1) != esc(model):
        return None
    return body[: m.start(1)] + esc(sent_model) + body[m.end(1) :]
