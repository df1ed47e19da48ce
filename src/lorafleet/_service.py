"""Pieces every lorafleet HTTP service shares: the error type, its handler, auth and body caps.

Endpoints raise ``ServiceError(code, message)``; one handler turns it into the protocol's error
envelope with the ``X-Lorafleet-Error-Code`` header. Nothing here knows about a specific service.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lorafleet._auth import check_bearer
from lorafleet.protocol.errors import ERROR_CODE_HEADER, STATUS_BY_CODE, ErrorCode, error_body

__all__ = [
    "DEFAULT_JSON_LIMIT",
    "JsonBodyLimit",
    "ServiceError",
    "error_response",
    "install_error_handlers",
    "read_json",
    "require_token",
]

# Control-plane JSON bodies are small; anything bigger is refused before it is parsed.
DEFAULT_JSON_LIMIT = 1 << 20


class ServiceError(Exception):
    """An error with a stable protocol code; the handler maps it to status and envelope."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}
        super().__init__(message)

    @property
    def status(self) -> int:
        return STATUS_BY_CODE.get(self.code, 500)


def error_response(
    code: str, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    status = STATUS_BY_CODE.get(code, 500)
    hdrs = {ERROR_CODE_HEADER: code, **(headers or {})}
    if status == 503 and "Retry-After" not in hdrs:
        hdrs["Retry-After"] = "1"
    return JSONResponse(error_body(code, message, param), status_code=status, headers=hdrs)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error (ours, FastAPI's validation, Starlette's 404/405) use the envelope."""

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc.code, exc.message, param=exc.param, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else "invalid request"
        return error_response(ErrorCode.INVALID_REQUEST, msg, param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {
            404: ErrorCode.NOT_FOUND,
            401: ErrorCode.UNAUTHORIZED,
            403: ErrorCode.FORBIDDEN,
            413: ErrorCode.BODY_TOO_LARGE,
        }.get(exc.status_code, ErrorCode.INVALID_REQUEST)
        resp = error_response(code, str(exc.detail))
        resp.status_code = exc.status_code
        return resp


def require_token(request: Request, expected: str | None) -> None:
    """Refuse the request unless it carries ``Authorization: Bearer <expected>``.

    A missing token is 401 and a wrong one is 403. The comparison is constant-time.
    ``expected=None`` disables the check (only when the operator configured no token).
    """
    if expected is None:
        return
    verdict = check_bearer(request.headers.get("authorization"), expected)
    if verdict == "missing":
        raise ServiceError(
            ErrorCode.UNAUTHORIZED,
            "missing control token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if verdict == "invalid":
        raise ServiceError(ErrorCode.FORBIDDEN, "invalid control token")


async def read_json(request: Request, limit: int = DEFAULT_JSON_LIMIT) -> Any:
    """Read a JSON body of at most ``limit`` bytes; 413 past it, 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServiceError(ErrorCode.BODY_TOO_LARGE, f"JSON body over the {limit} byte limit")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise ServiceError(ErrorCode.BODY_TOO_LARGE, f"JSON body over the {limit} byte limit")
    try:
        return json.loads(buf)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"body is not valid JSON: {exc}") from exc


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
                await self._refuse(scope, receive, send)
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
                await self._refuse(scope, receive, send)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(
            ErrorCode.BODY_TOO_LARGE, f"request body over the {self.limit} byte limit"
        )
        resp.headers["Connection"] = "close"
        await resp(scope, receive, send)
