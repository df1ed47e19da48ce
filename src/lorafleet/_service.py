"""What every lorafleet HTTP service shares: the one error mapper, auth and body caps.

Service logic raises ``lorafleet.errors.ServiceError`` subclasses; ``error_parts`` turns one into
status, headers and the protocol's envelope, for FastAPI apps (``install_error_handlers``) and for
the router's bare-ASGI data plane (``send_error``) alike. Nothing here knows a specific service.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lorafleet._auth import check_bearer
from lorafleet.errors import (
    BodyTooLarge,
    Forbidden,
    InternalError,
    InvalidRequest,
    NotFound,
    ServiceError,
    Unauthorized,
)
from lorafleet.protocol.errors import ERROR_CODE_HEADER, error_body

__all__ = [
    "DEFAULT_JSON_LIMIT",
    "JsonBodyLimit",
    "check_token",
    "error_parts",
    "error_response",
    "install_error_handlers",
    "read_json",
    "require_token",
    "send_error",
]

log = logging.getLogger("lorafleet.service")

# Control-plane JSON bodies are small; anything bigger is refused before it is parsed.
DEFAULT_JSON_LIMIT = 1 << 20


def error_parts(exc: ServiceError) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, JSON body) of the answer to ``exc``: the one server-side mapper."""
    status = exc.status
    headers = {ERROR_CODE_HEADER: exc.code, **exc.headers}
    if status == 503:
        headers.setdefault("Retry-After", "1")
    body = json.dumps(error_body(exc.code, exc.message, exc.param)).encode()
    return status, headers, body


def error_response(exc: ServiceError) -> Response:
    status, headers, body = error_parts(exc)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def send_error(send: Send, exc: ServiceError) -> None:
    """Answer ``exc`` on a bare ASGI ``send`` (the router's data plane)."""
    status, headers, body = error_parts(exc)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _validation_error(exc: RequestValidationError) -> ServiceError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ServiceError):
        # A model validator refused with a protocol error (a path trick in a FileEntry): keep
        # its precise code instead of the generic one.
        return cause
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else "invalid request"
    return InvalidRequest(msg, param=loc or None)


_HTTP_STATUS_ERRORS: dict[int, type[ServiceError]] = {
    404: NotFound,
    401: Unauthorized,
    403: Forbidden,
    413: BodyTooLarge,
}


def install_error_handlers(app: FastAPI) -> None:
    """Every error (ours, FastAPI's validation, Starlette's 404/405, anything unexpected) is
    answered in the protocol's envelope."""

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        cls = _HTTP_STATUS_ERRORS.get(exc.status_code, InvalidRequest)
        # The status stays Starlette's own (a 405 is not turned into a 400).
        return error_response(cls(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(InternalError(f"internal error: {type(exc).__name__}: {exc}"))


def check_token(
    authorization: str | bytes | None, expected: str | None, what: str = "control token"
) -> None:
    """Refuse unless ``authorization`` is ``Bearer <expected>``.

    Raises ``Unauthorized`` (401) for a missing token and ``Forbidden`` (403) for a wrong one.
    ``expected=None`` disables the check (only when the operator configured no token).
    """
    if expected is None:
        return
    verdict = check_bearer(authorization, expected)
    if verdict == "missing":
        raise Unauthorized(
            f"missing {what}: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if verdict == "invalid":
        raise Forbidden(f"invalid {what}")


def require_token(request: Request, expected: str | None, what: str = "control token") -> None:
    """``check_token`` on a FastAPI request (use as a dependency)."""
    check_token(request.headers.get("authorization"), expected, what)


async def read_json(request: Request, limit: int = DEFAULT_JSON_LIMIT) -> Any:
    """Read a JSON body of at most ``limit`` bytes; 413 past it, 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"JSON body over the {limit} byte limit")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(f"JSON body over the {limit} byte limit")
    try:
        return json.loads(buf)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from exc


class JsonBodyLimit:
    """Refuse request bodies over ``limit`` before anything parses them (413 ``body_too_large``).

    ``stream_prefix``: PUTs under this path stream raw bytes (uploads) and are capped elsewhere.
    """

    def __init__(self, app: ASGIApp, limit: int, stream_prefix: str | None = None) -> None:
        self.app = app
        self.limit = limit
        self.stream_prefix = stream_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamed = (
            self.stream_prefix is not None
            and scope.get("method") == "PUT"
            and scope.get("path", "").startswith(self.stream_prefix)
        )
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD") or streamed:
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                await self._refuse(send)
                return
        body = bytearray()
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                await self._refuse(send)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        exc = BodyTooLarge(
            f"request body over the {self.limit} byte limit", headers={"Connection": "close"}
        )
        await send_error(send, exc)
