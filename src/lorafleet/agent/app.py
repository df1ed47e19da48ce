"""The agent's HTTP surface: FastAPI routes over the upload manager and the adapter service.

Mutating routes need the control token; ``/health``, ``/v1/info``, ``/metrics`` and the OpenAPI
document are open. JSON bodies are capped by ``JsonBodyLimit`` before FastAPI parses them; the
upload PUT streams its raw body and is capped by the declared file size instead. Every route
documents each status it answers (``responses=``); nothing a client sends is answered with a 500.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request, Security
from fastapi.security import HTTPBearer

from lorafleet._service import (
    JsonBodyLimit,
    check_token,
    finish_openapi,
    install_error_handlers,
    service_app,
    token_guard,
)
from lorafleet.agent.config import AgentConfig
from lorafleet.agent.routes import AgentRoutes, adapters, reads, uploads
from lorafleet.agent.runtime import Runtime

__all__ = ["AgentConfig", "create_app"]

log = logging.getLogger("lorafleet.agent")


def create_app(cfg: AgentConfig) -> FastAPI:
    rt = Runtime(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        try:
            yield
        finally:
            await rt.stop()

    app = service_app("lorafleet agent", version="1", lifespan=lifespan)
    app.state.runtime = rt
    install_error_handlers(app)

    # Upload PUTs stream raw bytes, capped by the declared file size instead.
    app.add_middleware(JsonBodyLimit, limit=cfg.json_limit, stream_prefix="/v1/uploads/")

    guard = [Depends(token_guard(cfg.token))]
    relay_bearer = HTTPBearer(
        scheme_name="controlToken",
        description="Authorization: Bearer <control token>, or the publication's relay "
        "credential on a session opened with ``relay``",
        auto_error=False,
    )

    def upload_access(request: Request, upload_id: str, _: object = Security(relay_bearer)) -> bool:
        """The control token, or this session's relay credential (then True: a peer agent)."""
        authz = request.headers.get("authorization") or ""
        scheme, _sep, token = authz.partition(" ")
        if scheme.lower() == "bearer" and token and rt.uploads.relay_peer(upload_id, token.strip()):
            return True
        check_token(authz or None, cfg.token)
        return False

    # Every guarded route: a bad parameter or body (400), no or a wrong token (401, 403).
    ctl = (400, 401, 403)

    ctx = AgentRoutes(rt, guard, ctl, upload_access)
    for group in (uploads, adapters, reads):
        app.include_router(group.routes(ctx))

    finish_openapi(app)
    return app
