"""Client-side HTTP helpers: the clients lorafleet owns, and error answers as exceptions.

``async_client`` builds every httpx client lorafleet uses to reach its own services and the
engines: idle connections expire before the peers' keep-alive (uvicorn closes them after 5 s),
and a request that meets a connection the peer has just closed is sent again, once, on a fresh
one. ``raise_for_status`` turns an error answer into its ``ServiceError`` subclass, and
``error_message`` reads the message out of any engine's or service's error body (the agent's
engine backends use it too), so each answer shape is parsed here once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from lorafleet.errors import TransportError, error_for
from lorafleet.protocol.errors import ERROR_CODE_HEADER

__all__ = [
    "KEEPALIVE_EXPIRY_S",
    "StaleConnectionRetry",
    "async_client",
    "bearer",
    "error_message",
    "map_transport_errors",
    "raise_for_status",
]

KEEPALIVE_EXPIRY_S = 2.0
"""Below the 5 s after which uvicorn-based servers (ours, vLLM, SGLang) close idle connections."""

# What a request meets on a connection the server closed while it sat idle in the pool; nothing
# of the answer has arrived, so a replayable request may be sent again.
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
REPLAYABLE = {"lorafleet.replayable": True}
"""``extensions=REPLAYABLE`` marks a request that may be sent twice (a read-only probe)."""


class StaleConnectionRetry(httpx.AsyncBaseTransport):
    """Send a request again, once, when it failed before any answer on a pooled connection.

    Only reads and requests marked ``REPLAYABLE``: a server that closes the connection after
    acting on a request looks exactly like one that closed it idle, and a second alias flip (a
    compare-and-set PUT) or adapter load would then conflict with the first; the caller resolves
    that ambiguity (the Publisher asks the router whether its flip was applied).
    """

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self.transport = transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.transport.handle_async_request(request)
        except _STALE:
            # Only a body we still hold can be sent again (an upload streams from a generator
            # and resumes from the agent's offset instead).
            if not isinstance(request.stream, httpx.ByteStream):
                raise
            if request.method not in _SAFE and not request.extensions.get("lorafleet.replayable"):
                raise
            return await self.transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self.transport.aclose()


def async_client(
    *,
    timeout: float | httpx.Timeout = httpx.Timeout(60.0, connect=5.0),
    limits: httpx.Limits | None = None,
    **kwargs: object,
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` that survives peers closing idle keep-alive connections."""
    limits = limits or httpx.Limits()
    limits = httpx.Limits(
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=min(limits.keepalive_expiry or KEEPALIVE_EXPIRY_S, KEEPALIVE_EXPIRY_S),
    )
    transport = StaleConnectionRetry(httpx.AsyncHTTPTransport(limits=limits))
    return httpx.AsyncClient(timeout=timeout, transport=transport, **kwargs)  # type: ignore[arg-type]


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


def error_code(response: httpx.Response) -> str:
    """The protocol code of an error answer (its header, else its envelope), or ``http_error``."""
    code = response.headers.get(ERROR_CODE_HEADER, "")
    body = _body(response)
    if not code and isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = str(err.get("code") or err.get("type") or "")
    return code or "http_error"


_PASSED_ON = frozenset({"retry-after", "www-authenticate"})
"""The headers of an error answer that its ``ServiceError`` keeps (``raise_for_status``)."""


def raise_for_status(response: httpx.Response) -> httpx.Response:
    """Return ``response`` if it succeeded; raise the ``ServiceError`` for its code otherwise."""
    if response.is_success:
        return response
    raise error_for(
        error_code(response),
        error_message(response),
        status=response.status_code,
        url=str(response.url),
        # Only what an error passes on when a service answers with it again: the framing
        # headers (Content-Length above all) describe the remote body, not the next one.
        headers={k: v for k, v in response.headers.items() if k.lower() in _PASSED_ON},
    )


@contextlib.contextmanager
def map_transport_errors(url: str) -> Iterator[None]:
    """Re-raise httpx's no-response errors as ``TransportError``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise TransportError(f"{url}: {type(exc).__name__}: {exc}") from exc
