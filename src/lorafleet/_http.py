"""Client-side HTTP helpers: turn error responses into ``RemoteError`` in one place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from lorafleet.errors import RemoteError, TransportError
from lorafleet.protocol.errors import ERROR_CODE_HEADER

__all__ = ["bearer", "map_transport_errors", "raise_for_status"]


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def raise_for_status(response: httpx.Response) -> httpx.Response:
    """Return ``response`` if it succeeded; raise ``RemoteError`` with its code otherwise.

    Understands lorafleet's envelope, vLLM's (same shape), SGLang's ``{success, error_message}``
    and FastAPI's ``{detail}``; anything else is reported as text.
    """
    if response.is_success:
        return response
    code = response.headers.get(ERROR_CODE_HEADER, "")
    message = response.text
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            message = str(err.get("message", message))
            code = code or str(err.get("code") or err.get("type") or "")
        elif "error_message" in body:
            message = str(body["error_message"])
        elif "detail" in body:
            message = str(body["detail"])
        elif "message" in body:
            message = str(body["message"])
    raise RemoteError(response.status_code, code or "http_error", message, str(response.url))


@contextlib.contextmanager
def map_transport_errors(url: str) -> Iterator[None]:
    """Re-raise httpx's no-response errors as ``TransportError``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise TransportError(f"{url}: {type(exc).__name__}: {exc}") from exc
