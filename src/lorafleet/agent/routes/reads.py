"""Open reads: the agent's info, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest

from lorafleet._service import METRICS_RESPONSES, MetricsResponse
from lorafleet.agent.routes import AgentRoutes
from lorafleet.protocol.agent import AgentInfo, Health

__all__ = ["routes"]


def routes(ctx: AgentRoutes) -> APIRouter:
    """This group's routes over ``ctx.rt``."""
    api = APIRouter()
    rt = ctx.rt
    cfg = rt.cfg

    @api.get("/v1/info")
    async def info() -> AgentInfo:
        return AgentInfo(
            replica_id=cfg.replica_id,
            engine_url=cfg.engine_url,
            base_model=rt.base_model,
            capabilities=rt.caps,
            ready=rt.health().status == "ok",
        )

    @api.get("/health", responses={503: {"model": Health, "description": "Not ready"}})
    async def health() -> JSONResponse:
        h = rt.health()
        return JSONResponse(h.model_dump(), status_code=200 if h.status == "ok" else 503)

    @api.get("/metrics", response_class=MetricsResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        with contextlib.suppress(OSError):
            rt.metrics.store_bytes.set(await asyncio.to_thread(rt.store.usage))
        return MetricsResponse(generate_latest(rt.metrics.registry))

    return api
