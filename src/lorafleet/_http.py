"""Client-side HTTP helpers: error answers become ``ServiceError`` subclasses in one place.

``error_message`` reads the message out of any engine's or service's error body; the agent's
engine backends use it too, so each answer shape is parsed here once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from lorafleet.errors import TransportError, error_for
from lorafleet.protocol.errors import ERROR_CODE_HEADER

__all__ = ["bearer", "error_message", "map_transport_errors", "raise_for_status"]


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None


def error_message(response: httpx.Response) -> str:
    """The message of an error answer.

    Understands lorafleet's envelope and vLLM's (same shape), SGLang's ``{success,
    error_message}``, FastAPI's ``{detail}`` and ``{message}``; anything else is the text.
    """
    body = _body(response)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("error_message", "detail", "message"):
            if body.get(key):
                return str(body[key])
    return response.text.strip()


def raise_for_status(response: httpx.Response) -> httpx.Response:
    """Return ``response`` if it succeeded; raise the ``ServiceError`` for its code otherwise."""
    if response.is_success:
        return response
    code = response.headers.get(ERROR_CODE_HEADER, "")
    body = _body(response)
    if not code and isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = str(err.get("code") or err.get("type") or "")
    raise error_for(
        code or "http_error",
        error_message(response),
        status=response.status_code,
        url=str(response.url),
        headers=dict(response.headers),
    )


@contextlib.contextmanager
def map_transport_errors(url: str) -> Iterator[None]:
    """Re-raise httpx's no-response errors as ``TransportError``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise TransportError(f"{url}: {type(exc).__name__}: {exc}") from exc
