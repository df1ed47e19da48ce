"""The front's HTTP app: the routes of one trainer dialect over ``lorafleet.front.service.Front``.

Control calls pass ``Front.check_control``; reads are open, as on the server the dialect
impersonates. ``lorafleet.front.dialects`` holds the dialects; this module only assembles one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from lorafleet._service import JsonBodyLimit, finish_openapi, install_error_handlers
from lorafleet.front.dialects import DIALECTS
from lorafleet.front.forward import GENERATION_BODY_LIMIT
from lorafleet.front.service import Front, FrontConfig

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

    app = FastAPI(title=f"lorafleet front ({dialect.name})", lifespan=lifespan)
    app.state.front = front
    install_error_handlers(app)
    app.add_middleware(JsonBodyLimit, limit=GENERATION_BODY_LIMIT)

    def control(request: Request) -> None:
        client = request.client.host if request.client else None
        front.check_control(request.headers.get("authorization"), client)

    @app.get("/health", response_class=Response, responses={200: {"description": "Up (empty)"}})
    async def health() -> Response:
        return Response(status_code=200)

    for group in dialect.groups:
        app.include_router(group(front, Depends(control)))
    finish_openapi(app)
    return app
