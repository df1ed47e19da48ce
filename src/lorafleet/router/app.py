"""The router application: the control plane, with one data-plane copy in the same process.

``RouterApp`` hands the data plane's hot POST routes straight to its ``DataPlane``
(``lorafleet.dataplane``: the pipeline and the generation shapes) and everything else (control
plane, the data plane's FastAPI routes, ``/health``, ``/metrics``, ``/openapi.json``, lifespan)
to FastAPI. The OpenAPI document covers both: FastAPI's routes declare every status they answer,
and the hot paths are documented from the shapes (``dataplane/openapi.py``).
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import Depends, FastAPI

from lorafleet._service import (
    DEFAULT_JSON_LIMIT,
    JsonBodyLimit,
    finish_openapi,
    inference_guard,
    install_error_handlers,
    service_app,
    token_guard,
)
from lorafleet.dataplane import openapi as data_plane_openapi
from lorafleet.dataplane import routes as data_plane_routes
from lorafleet.dataplane.balancer import Balancer
from lorafleet.dataplane.health import HealthPoller
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.plane import DataPlane
from lorafleet.dataplane.sessions import Sessions
from lorafleet.dataplane.shapes import SHAPES
from lorafleet.router.catchup import CatchUp
from lorafleet.router.config import RouterConfig
from lorafleet.router.copies import Copies
from lorafleet.router.placement import Placer
from lorafleet.router.routes import (
    RouteContext,
    aliases,
    copies,
    leases,
    reads,
    registrations,
    replicas,
)
from lorafleet.router.sources import Sources
from lorafleet.router.table import AliasStore

__all__ = ["RouterApp", "RouterConfig", "create_app"]

log = logging.getLogger("lorafleet.router")


class RouterApp:
    """ASGI entry: hot POST routes to the data plane, the rest to FastAPI."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.store = AliasStore(config.state_dir, on_change=self._table_changed)
        self.balancer = Balancer(
            config.agents,
            unhealthy_after=config.unhealthy_after,
            healthy_after=config.healthy_after,
            sessions=Sessions(config.session_idle_s),
        )
        self.copies = Copies(
            lambda: self.store.aliases,
            lambda: [r.agent_url for r in self.balancer.replicas],
            self.balancer.sessions,
            lease_s=config.copy_lease_s,
        )
        self.metrics = RouterMetrics()
        self.plane = DataPlane(
            self.store,
            self.balancer,
            self.metrics,
            api_key=config.api_key,
            tenants=config.tenants,
            upstream_keepalive_s=config.upstream_keepalive_s,
            cold_wait_s=config.cold_wait_s,
            grow_at=config.grow_at,
        )
        self.placer = Placer(
            self.store,
            self.balancer,
            self.copies,
            self.metrics,
            token=config.agent_token,
            shrink_after_s=config.shrink_after_s,
            on_change=self.prune_metrics,
        )
        self.sources = Sources(
            self.store,
            self.copies,
            allow=config.source_allow,
            watch=config.watch_dirs,
            state_dir=config.state_dir,
            tenants=config.tenants,
            on_change=self.prune_metrics,
        )
        self.placer.sources = self.sources
        self.placer.tenants = config.tenants
        self.plane.warmer = self.placer
        self.poller: HealthPoller | None = None
        self.catch_up: CatchUp | None = None
        self.api = _build_api(self)

    async def __call__(self, scope, receive, send) -> None:
        if self.plane.wants(scope):
            await self.plane(scope, receive, send)
            return
        await self.api(scope, receive, send)

    def _table_changed(self) -> None:
        # Called from AliasStore.__init__ too, before ``copies`` exists: nothing to tell yet.
        copies = getattr(self, "copies", None)
        if copies is not None:
            copies.bump()

    def membership_changed(self) -> None:
        """A replica joined, left or moved: the copies poll a new set of agents."""
        self.copies.bump()

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI):
        await self.plane.start()
        assert self.plane.pooled is not None
        self.poller = HealthPoller(
            self.balancer,
            self.plane.pooled,
            interval_s=self.config.health_interval_s,
            timeout_s=self.config.health_timeout_s,
            token=self.config.agent_token,
            on_change=self._export_health,
        )
        await self.poller.poll_once()
        self.poller.start()
        self.sources.start()
        self.placer.start()
        if self.config.catch_up_interval_s > 0:
            self.catch_up = CatchUp(
                self.store,
                self.balancer,
                self.metrics,
                token=self.config.agent_token,
                interval_s=self.config.catch_up_interval_s,
                on_change=self.prune_metrics,
                make_room=self.placer.make_room,
            )
            self.catch_up.start()
        try:
            yield
        finally:
            if self.catch_up is not None:
                await self.catch_up.stop()
            await self.sources.stop()
            await self.placer.stop()
            await self.poller.stop()
            await self.plane.stop()

    def _export_health(self, balancer: Balancer) -> None:
        for r in balancer.replicas:
            self.metrics.replica_healthy.labels(r.replica_id or r.agent_url).set(
                1 if r.routable else 0
            )

    def prune_metrics(self) -> None:
        """Drop the series of every version that is neither routable nor in flight.

        Run at every scrape and at every alias change and drain: a router nobody scrapes
        otherwise kept ~6 KiB of series per published version for good (bench/soak.py).
        """
        if getattr(self, "placer", None) is not None:
            self.placer.prune()
        if getattr(self, "sources", None) is not None:
            self.sources.prune()
        active = {(name, v.version) for name, e in self.store.aliases.items() for v in e.window()}
        for adapter, version in list(self.metrics._children):
            if adapter is None or version is None or (adapter, version) in active:
                continue
            if self.balancer.count(adapter, version) == 0:
                self.metrics.forget(adapter, version)

    def export_gauges(self) -> None:
        """In-flight gauges are set at scrape time so the hot path does no gauge work.

        A version that is neither active nor in flight is retired: its series are dropped.
        """
        self.prune_metrics()
        for adapter, version in set(self.metrics._children) | set(self.balancer.inflight):
            _, gauge = self.metrics.children(adapter, version)
            gauge.set(self.balancer.count(adapter, version))
        for r in self.balancer.replicas:
            self.metrics.replica_inflight.labels(r.replica_id or r.agent_url).set(r.inflight)
        self.balancer.sessions.sweep()
        self.metrics.sessions.set(len(self.balancer.sessions))
        self.metrics.lagging.clear()
        self.metrics.lagging_since.clear()
        for name, e in self.store.aliases.items():
            for rid, lag in e.lagging.items():
                self.metrics.lagging.labels(name, rid).set(1)
                self.metrics.lagging_since.labels(name, rid).set(lag.since_version)
        self._export_table()

    def _export_table(self) -> None:
        # From the table at each scrape (holders and canary figures): a retired version's
        # series go with it.
        m = self.metrics
        m.canary_delta.clear()
        m.canary_passed.clear()
        m.holders.clear()
        passed = {"passed": 1, "failed": 0, "uninformative": -1}
        for name, e in self.store.aliases.items():
            for v in e.window():
                m.holders.labels(name, str(v.version)).set(len(v.replicas))
                for rid, c in v.canary.items():
                    key = (name, str(v.version), rid)
                    m.canary_passed.labels(*key).set(passed[c.outcome])
                    for against, mean, top in (
                        ("trainer", c.mean_vs_trainer, c.max_vs_trainer),
                        ("base", c.mean_vs_base, c.max_vs_base),
                    ):
                        m.canary_delta.labels(*key, against, "mean").set(mean)
                        m.canary_delta.labels(*key, against, "max").set(top)


def _build_api(router: RouterApp) -> FastAPI:
    cfg = router.config
    app = service_app("lorafleet router", lifespan=router.lifespan)
    install_error_handlers(app)
    app.add_middleware(JsonBodyLimit, limit=DEFAULT_JSON_LIMIT)

    ctl = [Depends(token_guard(cfg.control_token))]
    guard = inference_guard(cfg.api_key, cfg.tenants)
    inference = [Depends(guard)]
    # Every control route: a bad parameter or body (400), no or a wrong token (401, 403).
    guarded = (400, 401, 403)
    # The data plane's FastAPI routes: the API key or a tenant's token, when configured.
    keyed_on = cfg.api_key is not None or cfg.tenants is not None
    keyed = (401, 403) if keyed_on else ()

    ctx = RouteContext(router, ctl, inference, guarded, keyed)
    for group in (reads, aliases, leases, replicas, copies, registrations):
        app.include_router(group.routes(ctx))
    app.include_router(data_plane_routes.routes(router.plane, guard, keyed))
    finish_openapi(
        app,
        lambda schema: data_plane_openapi.document(schema, SHAPES, keyed=keyed_on),
    )
    return app


def create_app(config: RouterConfig) -> RouterApp:
    """The router's ASGI app."""
    return RouterApp(config)
