"""The generation shapes' per-replica requests, in-process: what each engine is sent."""

from __future__ import annotations

import json

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.shapes import HOT_PATHS, SHAPES, Dispatch
from lorafleet.dataplane.shapes.base import Call
from lorafleet.dataplane.shapes.openai import Completions

ROUTE = Route("policy", "policy", 3, "policy@v3", ["r0"], None)


def _call(body: bytes) -> Call:
    return Call({"path": "/v1/completions"}, None, None, body, json.loads(body), None, 0.0)


def _sent(body: bytes, kind: str = "vllm", route: Route = ROUTE) -> dict:
    replica = Replica("http://a", "r0", "http://e", base_model="tiny", kind=kind)
    call = _call(body)
    up = Completions().upstream(call, call.doc, route, replica)
    return {"data": up.data, "doc": json.loads(up.data), "sent_model": up.sent_model}


def test_a_body_naming_its_model_once_is_forwarded_as_its_own_bytes_with_the_engine_name():
    body = b'{"prompt": "hi",  "model" : "policy", "max_tokens": 2, "x": [1,2.50]}'
    out = _sent(body)
    assert out["data"] == body.replace(b'"policy"', b'"policy@v3"')  # spacing, 2.50 kept
    assert _sent(body, kind="sglang")["doc"]["model"] == "tiny:policy@v3"


def test_a_body_with_another_model_key_or_an_escaped_name_is_re_encoded():
    nested = b'{"model": "policy", "messages": [{"content": "x", "model": "other"}], "prompt": 1}'
    out = _sent(nested)
    assert out["doc"]["model"] == "policy@v3" and out["doc"]["messages"][0]["model"] == "other"
    escaped = b'{"model": "\\u0070olicy", "prompt": "hi"}'
    assert _sent(escaped)["doc"]["model"] == "policy@v3"


def test_a_clients_lora_path_is_dropped_and_a_base_model_request_goes_as_sent():
    out = _sent(b'{"model": "policy", "prompt": "hi", "lora_path": "other"}')
    assert "lora_path" not in out["doc"] and out["doc"]["model"] == "policy@v3"
    base = b'{"model":"tiny","prompt":"hi"}'
    route = Route("tiny", None, None, None, None, "tiny")
    assert _sent(base, route=route)["data"] == base


def test_the_hot_paths_and_the_dispatch_come_from_the_shapes():
    assert {s.path for s in SHAPES} == HOT_PATHS
    dispatch = Dispatch(SHAPES)
    assert type(dispatch.shape("/generate", {"text": "hi"})).__name__ == "SGLangGenerate"
    assert type(dispatch.shape("/generate", {"model": "p", "token_ids": [1]})).__name__ == (
        "TokenGenerate"
    )
