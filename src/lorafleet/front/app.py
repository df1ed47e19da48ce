"""The front's HTTP app: the routes of one trainer dialect over ``lorafleet.front.service.Front``.

Control calls pass ``Front.check_control`` (whose ``Caller`` a route that names an adapter
receives); reads and generation are open, as on the server the dialect impersonates, except with
tenants (``Front.check_reader``). ``lorafleet.front.dialects`` holds the dialects; this module
only assembles one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from lorafleet._service import (
    JsonBodyLimit,
    finish_openapi,
    install_error_handlers,
    service_app,
)
from lorafleet.front.dialects import DIALECTS
from lorafleet.front.dialects.skyrl import UPLOAD_PREFIX
from lorafleet.front.forward import GENERATION_BODY_LIMIT
from lorafleet.front.service import Front, FrontConfig
from lorafleet.protocol.tenants import Caller

__all__ = ["create_app"]


def create_app(cfg: FrontConfig) -> FastAPI:
    """The front's ASGI app. Raises ``ValueError`` for an unusable configuration."""
    dialect = DIALECTS.get(cfg.dialect)
    if dialect is None:
        raise ValueError(f"unknown dialect {cfg.dialect!r}; known: {', '.join(DIALECTS)}")
    front = Front(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await front.aclose()

    app = service_app(f"lorafleet front ({dialect.name})", lifespan=lifespan)
    app.state.front = front
    install_error_handlers(app)
    # Remote-upload PUTs stream raw bytes, capped per file by the upload path itself.
    app.add_middleware(JsonBodyLimit, limit=GENERATION_BODY_LIMIT, stream_prefix=UPLOAD_PREFIX)

    def control(request: Request) -> Caller:
        client = request.client.host if request.client else None
        return front.check_control(request.headers.get("authorization"), client)

    @app.get("/health", response_class=Response, responses={200: {"description": "Up (empty)"}})
    async def health() -> Response:
        return Response(status_code=200)

    # Where two groups of a dialect answer the same path and method, the first one's route is
    # the only one, served and documented (the SkyRL dialect's unload over the vLLM one's).
    taken: set[tuple[str, str]] = set()
    for group in dialect.groups:
        router = group(front, Depends(control))
        router.routes = [
            r
            for r in router.routes
            if not (isinstance(r, APIRoute) and {(r.path, m) for m in r.methods} & taken)
        ]
        taken |= {(r.path, m) for r in router.routes if isinstance(r, APIRoute) for m in r.methods}
        app.include_router(router)
    finish_openapi(app)
    return app
