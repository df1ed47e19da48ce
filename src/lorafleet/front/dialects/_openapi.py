"""How a dialect's routes document themselves: what schemathesis checks them against.

Routes that read their body themselves (to answer a trainer's malformed JSON with a precise 400
rather than FastAPI's 422) still declare that body's schema, the headers they require and every
status they answer.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from lorafleet._service import errors

__all__ = ["route_doc"]


def route_doc(
    body: type[BaseModel] | dict | None,
    *statuses: int,
    headers: tuple[str, ...] = (),
    text_ok: bool = False,
    relayed: tuple[int, ...] = (),
    ok: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``responses`` and ``openapi_extra`` for a route that reads its body itself: the body's
    schema (a model's, or a raw one), the headers it requires, and every error status.
    ``relayed``: statuses whose body is an engine's own envelope (vLLM's has an integer code);
    ``text_ok``: the success is vLLM's plain-text sentence."""
    extra: dict[str, Any] = {}
    if body is not None:
        schema = body if isinstance(body, dict) else body.model_json_schema()
        ctype = (
            "application/octet-stream" if schema.get("format") == "binary" else ("application/json")
        )
        extra["requestBody"] = {"required": True, "content": {ctype: {"schema": schema}}}
    if headers:
        extra["parameters"] = [
            {"name": h, "in": "header", "required": True, "schema": {"type": "string"}}
            for h in headers
        ]
    responses = errors(*statuses)
    for status in relayed:  # an engine's own refusal, passed on in its envelope (vLLM's)
        envelope = {"type": "object", "required": ["error"]}
        responses[status] = {
            "description": responses.get(status, {}).get("description", "The engine's refusal"),
            "content": {"application/json": {"schema": envelope}},
        }
    if text_ok:  # vLLM's plain-text success sentence
        ok = {"content": {"text/plain": {"schema": {"type": "string"}}}}
        responses[200] = {"description": "Done, in words", **ok}
    if ok is not None:  # a 200 of its own (e.g. ``streamed_ok``: JSON or server-sent events)
        responses[200] = ok
    return {"responses": responses, "openapi_extra": extra}
