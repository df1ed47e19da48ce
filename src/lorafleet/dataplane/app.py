"""One data-plane copy as its own process (``lorafleet dataplane``): no state it cannot rebuild.

``CopyApp`` serves the hot generation paths (``DataPlane``) and the data plane's FastAPI routes
over the table it last acknowledged (``sync.CopyTable``), learns membership from the control
plane's snapshots and polls the agents' health itself. It keeps serving that table when the
control plane is gone (docs/router.md: what happens when each process dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from fastapi import FastAPI, Response
from prometheus_client import generate_latest
from pydantic import BaseModel

from lorafleet._service import (
    DEFAULT_JSON_LIMIT,
    METRICS_RESPONSES,
    JsonBodyLimit,
    MetricsResponse,
    finish_openapi,
    inference_guard,
    install_error_handlers,
    service_app,
)
from lorafleet.clients.router import AsyncRouterClient
from lorafleet.dataplane import openapi, routes
from lorafleet.dataplane.balancer import Balancer
from lorafleet.dataplane.config import DataPlaneConfig
from lorafleet.dataplane.health import HealthPoller
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.plane import DataPlane
from lorafleet.dataplane.sessions import Sessions
from lorafleet.dataplane.shapes import SHAPES
from lorafleet.dataplane.sync import CopyTable, Syncer

__all__ = ["CopyApp", "CopyHealth", "create_copy_app"]

log = logging.getLogger("lorafleet.dataplane")

# How long startup waits for the first table before serving the base model only.
_FIRST_SYNC_S = 10.0
# How long /finish_session waits for the control plane to take the end (past it: ended here,
# and everywhere once the control plane is back).
_FLUSH_WAIT_S = 2.0


class CopyHealth(BaseModel):
    """``GET /health`` of a data-plane copy."""

    status: str
    copy_id: str
    seq: int
    """The table seq it routes by."""
    current: bool
    """Synced within its lease."""
    fenced: bool
    """It stalled and has not synced since: it refuses adapter requests."""
    control_plane: str
    """``reachable`` or ``unreachable`` (it then serves the last table it acknowledged)."""
    replicas: int
    healthy: int


class CopyApp:
    """ASGI entry of one copy: hot POST routes to the data plane, the rest to FastAPI."""

    def __init__(self, config: DataPlaneConfig) -> None:
        self.config = config
        self.copy_id = config.copy_id or f"{os.uname().nodename}#{os.getpid()}"
        self.table = CopyTable()
        self.balancer = Balancer(
            [],
            unhealthy_after=config.unhealthy_after,
            healthy_after=config.healthy_after,
            # The control plane ends sessions; the idle lifetime comes with its snapshots.
            sessions=Sessions(authority=False),
        )
        self.metrics = RouterMetrics()
        self.control = AsyncRouterClient(config.control_url, config.control_token)
        self.requests = 0
        self.syncer = Syncer(
            self.control,
            self.table,
            self.balancer,
            copy_id=self.copy_id,
            url=config.url,
            stall_s=config.stall_s,
            on_agents=self._membership,
            requests=lambda: self.requests,
        )
        self.plane = DataPlane(
            self.table,
            self.balancer,
            self.metrics,
            api_key=config.api_key,
            tenants=config.tenants,
            upstream_keepalive_s=config.upstream_keepalive_s,
            gate=self.syncer,
            warmer=self.syncer,
            cold_wait_s=config.cold_wait_s,
            grow_at=config.grow_at,
            on_session_end=lambda: self.syncer.flush(_FLUSH_WAIT_S),
        )
        self.poller: HealthPoller | None = None
        self._unwatching: set[asyncio.Future] = set()
        self.api = self._build_api()

    async def __call__(self, scope, receive, send) -> None:
        if self.plane.wants(scope):
            self.requests += 1
            await self.plane(scope, receive, send)
            return
        await self.api(scope, receive, send)

    def _membership(self, agents: list[str]) -> None:
        """The control plane's replica set: poll the new agents, forget the ones that left."""
        wanted = [a.rstrip("/") for a in agents]
        for r in list(self.balancer.replicas):
            if r.agent_url not in wanted:
                if self.poller is not None:
                    fut = asyncio.ensure_future(self.poller.unwatch(r))
                    self._unwatching.add(fut)
                    fut.add_done_callback(self._unwatching.discard)
                self.balancer.remove(r)
        known = {r.agent_url for r in self.balancer.replicas}
        for url in wanted:
            if url not in known:
                r = self.balancer.add(url)
                if self.poller is not None:
                    self.poller.watch(r)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI):
        await self.plane.start()
        assert self.plane.pooled is not None
        self.poller = HealthPoller(
            self.balancer,
            self.plane.pooled,
            interval_s=self.config.health_interval_s,
            timeout_s=self.config.health_timeout_s,
            token=self.config.agent_token or self.config.control_token,
        )
        self.poller.start()
        self.syncer.start()
        # Serve with a table when the control plane answers in time; without one, the base
        # model only, until the first sync lands.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.syncer.synced.wait(), _FIRST_SYNC_S)
        if self.syncer.synced.is_set():
            await self.poller.poll_once()
        else:
            log.warning("no table from %s yet: serving the base model", self.config.control_url)
        try:
            yield
        finally:
            await self.syncer.stop()
            await self.poller.stop()
            await self.plane.stop()
            await self.control.aclose()

    def health(self) -> CopyHealth:
        return CopyHealth(
            status="ok",
            copy_id=self.copy_id,
            seq=self.table.seq,
            current=self.syncer.current,
            fenced=self.syncer.fenced,
            control_plane="reachable" if self.syncer.reachable else "unreachable",
            replicas=len(self.balancer.replicas),
            healthy=sum(1 for r in self.balancer.replicas if r.routable),
        )

    def _build_api(self) -> FastAPI:
        cfg = self.config
        app = service_app("lorafleet data plane", lifespan=self.lifespan)
        install_error_handlers(app)
        app.add_middleware(JsonBodyLimit, limit=DEFAULT_JSON_LIMIT)
        guard = inference_guard(cfg.api_key, cfg.tenants)
        keyed_on = cfg.api_key is not None or cfg.tenants is not None
        keyed = (401, 403) if keyed_on else ()

        @app.get("/health", response_model=CopyHealth)
        async def health() -> CopyHealth:
            return self.health()

        @app.get("/metrics", response_class=MetricsResponse, responses=METRICS_RESPONSES)
        async def metrics() -> Response:
            for r in self.balancer.replicas:
                rid = r.replica_id or r.agent_url
                self.metrics.replica_inflight.labels(rid).set(r.inflight)
                self.metrics.replica_healthy.labels(rid).set(1 if r.routable else 0)
            self.metrics.sessions.set(len(self.balancer.sessions))
            return MetricsResponse(generate_latest(self.metrics.registry))

        app.include_router(routes.routes(self.plane, guard, keyed))
        finish_openapi(app, lambda schema: openapi.document(schema, SHAPES, keyed=keyed_on))
        return app


def create_copy_app(config: DataPlaneConfig) -> CopyApp:
    """One data-plane copy's ASGI app."""
    return CopyApp(config)
