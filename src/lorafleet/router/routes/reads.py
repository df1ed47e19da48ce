"""Reads: the router's health, its metrics, the models it serves, and ending a session."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from prometheus_client import generate_latest

from lorafleet._service import METRICS_RESPONSES, MetricsResponse, errors
from lorafleet.protocol.router import RouterHealth
from lorafleet.router.routes import RouteContext

__all__ = ["routes"]


def routes(ctx: RouteContext) -> APIRouter:
    """This group's routes over ``ctx.router``."""
    api = APIRouter()
    router = ctx.router
    inference = ctx.inference
    keyed = ctx.keyed
    store = ctx.router.store
    balancer = ctx.router.balancer

    @api.get("/health", response_model=RouterHealth)
    async def health() -> RouterHealth:
        healthy = sum(1 for r in balancer.replicas if r.routable)
        return RouterHealth(status="ok", replicas=len(balancer.replicas), healthy=healthy)

    @api.get("/metrics", response_class=MetricsResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        router.export_gauges()
        return MetricsResponse(generate_latest(router.metrics.registry))

    @api.get("/v1/models", dependencies=inference, responses=errors(*keyed))
    async def models() -> dict:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "lorafleet", "root": m}
            for m in sorted(balancer.base_models())
        ]
        parent = data[0]["id"] if data else None
        # Aliases by their public names only: engine-side names (policy@v3) stay inside.
        for name, e in sorted(store.aliases.items()):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "lorafleet",
                    "root": name,
                    "parent": parent,
                    "version": e.version,
                    "versions": [v.version for v in e.window()],
                }
            )
        return {"object": "list", "data": data}

    @api.post("/finish_session", dependencies=inference, responses=errors(400, 413, *keyed))
    async def finish_session(session_id: str) -> dict:
        """Forget a sticky session (SkyRL calls this when a trajectory ends)."""
        balancer.forget_session(session_id)
        return {"ok": True}

    return api
