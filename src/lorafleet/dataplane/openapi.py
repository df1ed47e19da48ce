"""The data plane's hot paths in the OpenAPI document, derived from the shapes (FastAPI never
sees them: the pipeline answers them as bare ASGI).

Each path documents its body (the shape's model; a path two shapes share takes either), 200 with
the engine's answer tagged (JSON, or server-sent events where the shape streams), the engine's
own error statuses relayed with engine-side names scrubbed, and the data plane's own refusals
(``DATA_PLANE_ERRORS``, each status with its codes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from lorafleet._service import describe, streamed_ok
from lorafleet.dataplane.pipeline import DATA_PLANE_ERRORS, MAX_BODY
from lorafleet.dataplane.shapes.base import Shape
from lorafleet.protocol.errors import STATUS_BY_CODE, ErrorResponse

__all__ = ["document"]

_WHY = {
    400: "; or the engine's own 400, relayed",
    404: " for the model; or the engine's own 404, relayed",
    413: f": the body is over {MAX_BODY >> 20} MiB",
}
"""What the data plane adds to a status's description (the codes come from DATA_PLANE_ERRORS)."""


def _schema_ref(schemas: dict, shape: Shape) -> dict:
    """The shape's body model in ``schemas``, its nested models prefixed with the shape's name
    (two shapes may each have a ``SamplingParams``); a reference to it."""
    prefix = type(shape).__name__
    name = prefix + "Request"
    if name not in schemas:
        doc = shape.model.model_json_schema(ref_template="#/components/schemas/{model}")
        defs = doc.pop("$defs", {})
        raw = json.dumps({"doc": doc, "defs": defs})
        for k in defs:
            raw = raw.replace(f'"#/components/schemas/{k}"', f'"#/components/schemas/{prefix}{k}"')
        renamed = json.loads(raw)
        for k, v in renamed["defs"].items():
            schemas.setdefault(prefix + k, v)
        schemas[name] = renamed["doc"]
    return {"$ref": f"#/components/schemas/{name}"}


def document(schema: dict, shapes: Sequence[Shape], *, keyed: bool) -> None:
    """Add every shape's path to ``schema`` (``keyed``: the API key guards them)."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    if "ErrorResponse" not in schemas:
        doc = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(doc.pop("$defs", {}))
        schemas["ErrorResponse"] = doc
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    # The engine's own refusals are relayed in its envelope (vLLM: an integer code).
    relayed = {"anyOf": [error, {"type": "object", "required": ["error"]}]}
    own: dict[int, list[str]] = {}
    for cls in DATA_PLANE_ERRORS:
        status = STATUS_BY_CODE[cls.code]
        if keyed or status not in (401, 403):
            own.setdefault(status, []).append(cls.code)
    by_path: dict[str, list[Shape]] = {}
    for s in shapes:
        by_path.setdefault(s.path, []).append(s)
    for path, group in by_path.items():
        bodies = [_schema_ref(schemas, s) for s in group]
        ok = streamed_ok(
            "The engine's answer, tagged with the version (a lorafleet field in the JSON body, "
            "or one extra event before data: [DONE] in a stream)"
        )
        if not any(s.streams for s in group):
            del ok["content"]["text/event-stream"]
        responses: dict = {"200": ok}
        for status in sorted(own):
            why = describe(status, own[status]) + _WHY.get(status, "")
            body = relayed if status in (400, 404) else error
            responses[str(status)] = {
                "description": why,
                "content": {"application/json": {"schema": body}},
            }
        op: dict = {
            "summary": "; or ".join(s.summary for s in group),
            "operationId": "data_plane_" + path.strip("/").replace("/", "_"),
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
                    }
                },
            },
            "responses": responses,
        }
        if keyed:
            op["security"] = [{"apiKey": []}]
        schema["paths"][path] = {"post": op}
    if keyed:
        components.setdefault("securitySchemes", {})["apiKey"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "Authorization: Bearer <API key>",
        }
