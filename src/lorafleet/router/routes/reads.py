"""Reads: the router's health and its metrics (the models and sessions are the data plane's)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import generate_latest

from lorafleet._service import METRICS_RESPONSES, MetricsResponse
from lorafleet.protocol.router import RouterHealth
from lorafleet.router.routes import RouteContext

__all__ = ["routes"]


def routes(ctx: RouteContext) -> APIRouter:
    """This group's routes over ``ctx.router``."""
    api = APIRouter()
    router = ctx.router
    balancer = ctx.router.balancer

    @api.get("/health", response_model=RouterHealth)
    async def health() -> RouterHealth:
        healthy = sum(1 for r in balancer.replicas if r.routable)
        return RouterHealth(status="ok", replicas=len(balancer.replicas), healthy=healthy)

    @api.get("/metrics", response_class=MetricsResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        router.export_gauges()
        return MetricsResponse(generate_latest(router.metrics.registry))

    return api
