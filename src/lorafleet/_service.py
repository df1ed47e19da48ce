"""What every lorafleet HTTP service shares: the one error mapper, auth, body caps and the
shape of the OpenAPI documents.

Service logic raises ``lorafleet.errors.ServiceError`` subclasses; ``error_parts`` turns one into
status, headers and the protocol's envelope, for FastAPI apps (``install_error_handlers``) and for
the router's bare-ASGI data plane (``send_error``) alike. ``errors(...)`` documents the statuses a
route answers (each with its codes, from ``STATUS_BY_CODE``), ``token_guard`` the bearer scheme,
``finish_openapi`` what FastAPI documents on its own but lorafleet never answers, ``service_app``
the app itself. Nothing here knows a specific service.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lorafleet._auth import check_bearer
from lorafleet.errors import (
    BodyTooLarge,
    Forbidden,
    InternalError,
    InvalidRequest,
    NotFound,
    PathError,
    ServiceError,
    Unauthorized,
)
from lorafleet.protocol.errors import ERROR_CODE_HEADER, STATUS_BY_CODE, ErrorResponse, error_body
from lorafleet.protocol.tenants import OPERATOR, Caller, Tenants

__all__ = [
    "DEFAULT_JSON_LIMIT",
    "METRICS_RESPONSES",
    "SSE_EVENT_SCHEMA",
    "STATUS_SUMMARY",
    "JsonBodyLimit",
    "MetricsResponse",
    "check_token",
    "codes_for",
    "describe",
    "error_parts",
    "error_response",
    "errors",
    "finish_openapi",
    "identify_caller",
    "inference_guard",
    "install_error_handlers",
    "read_json",
    "require_token",
    "send_error",
    "service_app",
    "streamed_ok",
    "tenant_or_control_guard",
    "token_guard",
]

log = logging.getLogger("lorafleet.service")


def service_app(title: str, **kwargs: Any) -> FastAPI:
    """A FastAPI app as every lorafleet service builds one: a path that matches no route is that
    path's 404, never a redirect. (FastAPI's default ``redirect_slashes`` sends ``DELETE
    /v1/control/leases/policy/``, an empty holder, with a 307 to the operator's lease-break
    route: a client that follows redirects would break the lease.)"""
    return FastAPI(title=title, redirect_slashes=False, **kwargs)


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
        # A model validator refused with a protocol error (a path trick in a FileEntry, a name
        # outside the rule): keep its precise code instead of the generic one, and name the
        # field it refused where it sits (``lease_holder``, ``manifest.name``).
        where = [str(p) for p in first.get("loc", ())]
        if where and where[0] in ("body", "path", "query", "header", "cookie"):
            where = where[1:]
        if where and not isinstance(cause, PathError):
            cause.param = ".".join(where)
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
        # The status stays Starlette's own (a 405 is not turned into a 400), and so do its
        # headers (a 405's Allow).
        return error_response(
            cls(str(exc.detail), status=exc.status_code, headers=exc.headers or None)
        )

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


def identify_caller(
    authorization: str | bytes | None,
    operator: str | None,
    tenants: Tenants | None,
    what: str = "control token",
    *,
    open_without_operator: bool = True,
) -> Caller:
    """Who ``authorization`` is: the operator (its token is ``operator``) or a tenant.

    Without ``tenants`` this is ``check_token`` (``operator`` None: open). With them, a tenant's
    token is that tenant; the operator's token is the operator; no token is ``Unauthorized``
    (401) and any other token ``Forbidden`` (403). ``operator`` None with
    ``open_without_operator``: the service is open, and a request without a tenant's token is
    the operator's (a tenant's still scopes it); without it, a tenant's token is required.
    Every comparison is constant-time.
    """
    if tenants is None:
        check_token(authorization, operator, what)
        return OPERATOR
    # An empty expected token never matches (an empty bearer token is "missing").
    verdict = check_bearer(authorization, operator or "")
    if operator is not None and verdict == "ok":
        return OPERATOR
    tenant = tenants.identify(authorization)
    if tenant is not None:
        return Caller(tenant)
    if operator is None and open_without_operator:
        return OPERATOR
    if verdict == "missing":
        raise Unauthorized(
            f"missing {what}: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
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


# --- the OpenAPI documents -----------------------------------------------------------------

STATUS_SUMMARY: dict[int, str] = {
    400: "Invalid request: a malformed body, parameter or name",
    401: "No credentials: send 'Authorization: Bearer <token>'",
    403: "Wrong credentials, or a path outside the allow-list",
    404: "Not found",
    408: "A relayed upload received no byte for its stall limit; resume it",
    409: "Conflicts with the current state",
    413: "Too large",
    422: "Bytes or adapter differ from what was declared",
    500: "An unexpected error in the service",
    502: "The engine refused, did not apply the adapter, or broke off its answer",
    503: "The engine or every replica is unavailable; retry later",
    507: "The store cannot take the bytes",
}
"""What each status of ``STATUS_BY_CODE`` means, in a phrase; the codes come from the table."""


def codes_for(status: int) -> list[str]:
    """The protocol codes answered with ``status``, in ``STATUS_BY_CODE``'s order."""
    return [code for code, s in STATUS_BY_CODE.items() if s == status]


def describe(status: int, codes: Iterable[str] | None = None) -> str:
    """A status's documentation: its phrase and its codes (default: every code of ``status``)."""
    listed = list(codes) if codes is not None else codes_for(status)
    return f"{STATUS_SUMMARY[status]} ({', '.join(listed)})"


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status it can answer, in the protocol's envelope, with
    the codes ``STATUS_BY_CODE`` maps to it."""
    return {s: {"model": ErrorResponse, "description": describe(s)} for s in statuses}


class MetricsResponse(Response):
    """Prometheus's text exposition, documented (and served) with its real content type."""

    media_type = CONTENT_TYPE_LATEST


METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition",
        "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
    }
}
"""``responses=`` for ``GET /metrics`` (with ``response_class=MetricsResponse``)."""


SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "One server-sent event, by its fields: data is one JSON chunk, an error "
    "event (an object with an error field), or [DONE]",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
    "required": ["data"],
}
"""The schema of each event of a ``text/event-stream`` answer. OpenAPI 3.2 calls it the media
type's ``itemSchema``; before 3.2 (FastAPI writes 3.1), tools such as schemathesis read an event
stream's ``schema`` as one event's, so that is where it goes."""


def streamed_ok(description: str) -> dict[str, Any]:
    """A 200 that is one JSON body, or server-sent events when the request asks to stream."""
    return {
        "description": description,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": SSE_EVENT_SCHEMA},
        },
    }


def token_guard(
    expected: str | None, what: str = "control token", scheme: str = "controlToken"
) -> Callable[..., None]:
    """A FastAPI dependency that enforces ``check_token`` and documents the bearer scheme.

    With ``expected=None`` (no token configured) the route is open and documents no scheme.
    """
    if expected is None:

        def open_route() -> None:
            return None

        return open_route

    bearer = _bearer_scheme(what, scheme)

    def guard(request: Request, _: object = Security(bearer)) -> None:
        require_token(request, expected, what)

    return guard


def _bearer_scheme(what: str, scheme: str) -> HTTPBearer:
    return HTTPBearer(
        scheme_name=scheme, description=f"Authorization: Bearer <{what}>", auto_error=False
    )


def inference_guard(api_key: str | None, tenants: Tenants | None) -> Callable[..., Caller]:
    """A FastAPI dependency for the data plane's routes: the inference key is the operator's,
    a tenant's token that tenant's (``identify_caller``); returns the ``Caller``.

    Neither configured: open, the operator's, and no scheme documented. Tenants without a key:
    a tenant's token is required (401 without).
    """
    if api_key is None and tenants is None:

        def open_route() -> Caller:
            return OPERATOR

        return open_route

    bearer = _bearer_scheme("API key", "apiKey")

    def guard(request: Request, _: object = Security(bearer)) -> Caller:
        return identify_caller(
            request.headers.get("authorization"),
            api_key,
            tenants,
            "API key",
            open_without_operator=False,
        )

    return guard


def tenant_or_control_guard(
    control_token: str | None, tenants: Tenants | None
) -> Callable[..., Caller]:
    """A FastAPI dependency for a control route that a tenant may call too (registering a name
    of its own): the control token is the operator's (every name), a tenant's token that
    tenant's; returns the ``Caller``, whose ``owns(name)`` the route checks before it touches
    ``name``. Without ``tenants`` it is ``token_guard``'s check.

    Every other control route keeps ``token_guard(control_token)``: a tenant's token is refused
    there (403), as any wrong token is. With no control token the control plane is open: a
    request without a tenant's token is the operator's.
    """
    bearer = _bearer_scheme("control token", "controlToken")

    def guard(request: Request, _: object = Security(bearer)) -> Caller:
        return identify_caller(request.headers.get("authorization"), control_token, tenants)

    if control_token is None and tenants is None:

        def open_route(request: Request) -> Caller:
            return OPERATOR

        return open_route
    return guard


def finish_openapi(app: FastAPI, edit: Callable[[dict], None] | None = None) -> None:
    """Generate ``app``'s OpenAPI document once, without what lorafleet never answers.

    FastAPI documents a 422 ``HTTPValidationError`` on every route with parameters; lorafleet
    answers validation errors with 400 in its envelope (``errors(400)``), so those go. ``edit``
    then adds what FastAPI cannot see (the router's bare-ASGI data plane).
    """
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = base()
        for item in schema.get("paths", {}).values():
            for op in item.values():
                responses = op.get("responses", {})
                auto = responses.get("422", {}).get("content", {}).get("application/json", {})
                if auto.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                    del responses["422"]
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if edit is not None:
            edit(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
