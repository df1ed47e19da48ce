"""The reference engine's HTTP app: one router per dialect, plus errors, auth and metrics.

``create_app(runtime)`` assembles:

- ``_openai``: the OpenAI routes (models, completions, chat, streaming), bodies in
  ``_openai_bodies``;
- ``_vllm_admin``: vLLM's runtime-LoRA routes;
- ``_sglang``: SGLang's runtime-LoRA routes, ``/generate`` and its info routes;
- here: ``/health``, ``/metrics``, vLLM's error envelope everywhere, and the API key.

``dialect="sglang"`` makes the engine a stand-in for real SGLang 0.5.23 (``_sglang.SGLangDialect``):
no vLLM routes, SGLang's addressing on the OpenAI routes, and FastAPI's bare ``{"detail": ...}``
for an unknown route, as SGLang answers one.

The OpenAPI document lists every status each route answers (and, with an API key, its 401).

Route handlers only translate HTTP to runtime calls and back; model work happens on the
runtime's worker thread, never on the event loop.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafleet._auth import check_bearer
from lorafleet._service import METRICS_RESPONSES, MetricsResponse, finish_openapi, service_app
from lorafleet.engine import _openai, _sglang, _vllm_admin
from lorafleet.engine._errors import EngineError, error_body
from lorafleet.engine._metrics import EngineMetrics
from lorafleet.engine._runtime import Runtime
from lorafleet.engine._sglang import SGLangDialect, SGLangError

__all__ = ["create_app"]


def _add_error_handlers(app: FastAPI, dialect: str) -> None:
    """vLLM's envelope for every error, whichever route or layer raised it (SGLang's own shapes
    in its dialect)."""

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        message = "; ".join(parts) or "invalid request"
        if dialect == "sglang":
            return JSONResponse(SGLangError(message).body(), status_code=400)
        return JSONResponse(error_body(400, "BadRequestError", message), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if dialect == "sglang":
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return JSONResponse(
            error_body(exc.status_code, kind, str(exc.detail)),
            status_code=exc.status_code,
            headers=exc.headers,  # a 405's Allow
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, "InternalServerError", str(exc)), status_code=500)


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    """vLLM's ``--api-key``: a bearer token on /v1/* and SGLang's routes; ops routes stay open."""

    # Installed even without a key, so that every app streams through the same middleware stack.
    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if (
            api_key is not None
            and _guarded(request.url.path)
            and request.method != "OPTIONS"
            and check_bearer(request.headers.get("authorization"), api_key) != "ok"
        ):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)


def _guarded(path: str) -> bool:
    return path.startswith("/v1") or path in _sglang.GUARDED_PATHS


def _document_auth(schema: dict) -> None:
    """The API key's bearer scheme and vLLM's 401 on every guarded route."""
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "Authorization: Bearer <API key> (vLLM's --api-key)",
    }
    unauthorized = {
        "description": "No or a wrong API key (vLLM's answer)",
        "content": {
            "application/json": {
                "schema": {"type": "object", "properties": {"error": {"type": "string"}}}
            }
        },
    }
    for path, item in schema.get("paths", {}).items():
        if not _guarded(path):
            continue
        for op in item.values():
            op["security"] = [{"apiKey": []}]
            op.setdefault("responses", {})["401"] = unauthorized


def create_app(
    runtime: Runtime,
    *,
    api_key: str | None = None,
    dialect: str = "vllm",
    sglang_upsert: bool = False,
) -> FastAPI:
    """The engine's ASGI app. ``api_key`` guards /v1/* and SGLang's routes like vLLM's --api-key.

    ``dialect``: "vllm" (vLLM's, with SGLang's routes beside it) or "sglang" (real SGLang
    0.5.23's, see ``_sglang``); ``sglang_upsert``: in SGLang's dialect, honour the Miles fork's
    ``upsert``.
    """
    if dialect not in ("vllm", "sglang"):
        raise ValueError(f"unknown dialect {dialect!r}")
    app = service_app("lorafleet reference engine", docs_url=None, redoc_url=None)
    metrics = EngineMetrics()
    sglang = SGLangDialect(runtime, upsert=sglang_upsert) if dialect == "sglang" else None
    _add_error_handlers(app, dialect)
    _add_auth(app, api_key)

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "Serving (an empty body, as vLLM's)"}},
    )
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics", response_class=MetricsResponse, responses=METRICS_RESPONSES)
    async def prometheus() -> Response:
        metrics.adapters_loaded.set(len(runtime.adapters))
        return MetricsResponse(generate_latest(metrics.registry))

    app.include_router(_openai.router(runtime, metrics, sglang))
    if sglang is None:
        app.include_router(_vllm_admin.router(runtime, metrics))
    app.include_router(_sglang.router(runtime, metrics, sglang))
    app.state.runtime = runtime
    app.state.metrics = metrics
    finish_openapi(app, _document_auth if api_key is not None else None)
    return app
