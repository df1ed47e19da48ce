"""The version tag every routed answer carries, and what a client never sees.

A 200 JSON answer gets a ``lorafleet`` field (``VersionTag``) spliced in before its closing brace
and the ``X-Lorafleet-*`` headers; a stream gets one extra event just before ``data: [DONE]``.
An engine's error never shows a client an engine-side name (``policy@v3`` becomes the name the
client used), whatever order the names are replaced in.
"""

from __future__ import annotations

import json
import re
import time

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.errors import StreamInterrupted
from lorafleet.protocol.errors import error_body
from lorafleet.protocol.router import ADAPTER_HEADER, REPLICA_HEADER, TAG_FIELD, VERSION_HEADER

__all__ = [
    "DONE",
    "MODEL_RE",
    "broke_off",
    "error_event",
    "esc",
    "scrub",
    "splice_tag",
    "tag",
    "tag_doc",
    "tag_event",
    "tag_headers",
]

DONE = b"data: [DONE]"
MODEL_RE = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)*)"')
# A versioned engine-side name (``policy@v3``) anywhere in an engine's error text.
_ENGINE_NAME_RE = re.compile(rb"([A-Za-z0-9][A-Za-z0-9._-]*)@v[0-9]+")
# ASGI header names are lower-case bytes.
_H_ADAPTER = ADAPTER_HEADER.lower().encode()
_H_VERSION = VERSION_HEADER.lower().encode()
_H_REPLICA = REPLICA_HEADER.lower().encode()
_TAG_KEY = b'"' + TAG_FIELD.encode() + b'":'
_STREAM_OBJECT = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat.completion.chunk",
}


def esc(s: str) -> bytes:
    """``s`` as the inside of a JSON string."""
    return json.dumps(s)[1:-1].encode()


def tag(route: Route, replica: Replica, engine_model: bytes | None = None) -> bytes:
    """The ``lorafleet`` tag's JSON: which adapter version and replica produced the answer."""
    doc = {"adapter": route.adapter, "version": route.version, "replica": replica.replica_id}
    if engine_model is not None:
        doc["engine_model"] = engine_model.decode("utf-8", "replace")
    return json.dumps(doc, separators=(",", ":")).encode()


def tag_doc(route: Route, replica: Replica) -> dict:
    """The tag as a JSON-ready value (for answers the data plane builds itself)."""
    return {"adapter": route.adapter, "version": route.version, "replica": replica.replica_id}


def tag_headers(route: Route, replica: Replica) -> list[tuple[bytes, bytes]]:
    return [
        (_H_ADAPTER, (route.adapter or "").encode()),
        (_H_VERSION, b"" if route.version is None else str(route.version).encode()),
        (_H_REPLICA, (replica.replica_id or "").encode()),
    ]


def splice_tag(body: bytes, route: Route, replica: Replica, sent_model: str | None) -> bytes:
    """A 200 JSON object answer with the client's name for the engine-side ``model`` and the
    tag as its last field, by splicing bytes (no re-encoding of what the engine wrote)."""
    m = MODEL_RE.search(body)
    engine_model = m.group(1) if m else None
    rename = route.engine_name is not None and route.alias is not None and sent_model
    if m and rename and engine_model == esc(sent_model):  # type: ignore[arg-type]
        body = body[: m.start(1)] + esc(route.alias) + body[m.end(1) :]  # type: ignore[arg-type]
    body = body.rstrip()
    if body.endswith(b"}"):
        sep = b"" if body[:-1].rstrip().endswith(b"{") else b","
        body = body[:-1] + sep + _TAG_KEY + tag(route, replica, engine_model) + b"}"
    return body


def tag_event(route: Route, replica: Replica, engine_model: bytes | None, path: str) -> bytes:
    """The stream's tag: one event with empty ``choices``, sent just before ``data: [DONE]``."""
    head = {
        "id": "lorafleet-tag",
        "object": _STREAM_OBJECT.get(path, "text_completion"),
        "created": int(time.time()),
        "model": route.alias,
        "choices": [],
    }
    doc = json.dumps(head, separators=(",", ":")).encode()
    return b"data: " + doc[:-1] + b"," + _TAG_KEY + tag(route, replica, engine_model) + b"}\n\n"


def scrub(body: bytes, route: Route, sent_model: str | None) -> bytes:
    """An engine's error text with the client's alias for every engine-side name."""
    if route.alias is None:
        return _ENGINE_NAME_RE.sub(rb"\1", body)
    alias = esc(route.alias)
    if route.engine_name is not None:
        # Longest first: ``tiny:p@v1`` must not lose its ``p@v1`` before it is replaced.
        internals = {sent_model, route.engine_name} - {None, "", route.alias}
        for internal in sorted(internals, key=len, reverse=True):  # type: ignore[arg-type]
            body = body.replace(esc(internal), alias)
    # Any other versioned engine name loses its version; the client's own (a pinned
    # ``policy@v3``) stays as the client wrote it.
    return _ENGINE_NAME_RE.sub(lambda m: m[0] if m[0] == alias else m[1], body)


def broke_off(exc: BaseException) -> str:
    return f"the engine's answer broke off: {type(exc).__name__}: {exc}"


def error_event(message: str) -> bytes:
    """An SSE error event in the protocol's envelope, then the end of the stream."""
    exc = StreamInterrupted(message)
    doc = json.dumps(error_body(exc.code, exc.message), separators=(",", ":")).encode()
    return b"data: " + doc + b"\n\n" + DONE + b"\n\n"
