"""Server-sent events as vLLM and SGLang frame them: ``data: <json>\\n\\n`` ... ``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

__all__ = ["DONE", "event", "streaming_response"]

DONE = "data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: dict) -> str:
    """One SSE frame holding ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def streaming_response(frames: AsyncIterator[str]) -> StreamingResponse:
    """A ``text/event-stream`` response that proxies do not buffer."""
    return StreamingResponse(frames, media_type="text/event-stream", headers=_HEADERS)
