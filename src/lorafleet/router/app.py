"""The router application: the bare-ASGI data plane in front of a FastAPI control plane.

``RouterApp`` dispatches the three POST inference routes straight to ``Proxy`` and everything else
(control plane, ``/v1/models``, ``/health``, ``/metrics``, ``/openapi.json``, lifespan) to FastAPI.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from fastapi import Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lorafleet._service import (
    DEFAULT_JSON_LIMIT,
    JsonBodyLimit,
    install_error_handlers,
    require_token,
)
from lorafleet.errors import VersionConflict
from lorafleet.protocol.router import (
    AliasEntry,
    AliasTable,
    DrainRequest,
    DrainResponse,
    Lease,
    LeaseRequest,
    ReplicaList,
    ReplicaStatus,
    SetAliasRequest,
)
from lorafleet.router.balancer import Balancer
from lorafleet.router.health import HealthPoller
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.proxy import Proxy
from lorafleet.router.table import AliasStore

__all__ = ["RouterApp", "RouterConfig", "create_app"]

HOT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


@dataclass
class RouterConfig:
    agents: list[str]
    control_token: str | None = None
    api_key: str | None = None
    agent_token: str | None = None
    state_dir: str | None = None
    health_interval_s: float = 0.5
    health_timeout_s: float = 5.0
    """A busy machine can take seconds to answer a probe; that alone does not drop a replica."""
    unhealthy_after: int = 3
    healthy_after: int = 2
    upstream_keepalive_s: float = 2.0
    """Idle pooled connections to engines and agents are dropped after this: below the 5 s after
    which uvicorn (the reference engine, the agent, vLLM, SGLang) closes them itself."""
    extra: dict = field(default_factory=dict)


class RouterApp:
    """ASGI entry: hot POST routes to the proxy, the rest to FastAPI."""

    def __init__(self, config: RouterConfig, *, proxy_class: Callable[..., Proxy] = Proxy) -> None:
        self.config = config
        self.proxy_class = proxy_class
        self.store = AliasStore(config.state_dir)
        self.balancer = Balancer(
            config.agents,
            unhealthy_after=config.unhealthy_after,
            healthy_after=config.healthy_after,
        )
        self.metrics = RouterMetrics()
        self.proxy: Proxy | None = None
        self.poller: HealthPoller | None = None
        self.api = _build_api(self)

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] in HOT_PATHS
            and scope["method"] == "POST"
            and self.proxy is not None
        ):
            await self.proxy(scope, receive, send)
            return
        await self.api(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI):
        # Pool keep-alive connections to the engines; no total timeout: generations are long.
        def session(**connector: object) -> aiohttp.ClientSession:
            return aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, **connector),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )

        pooled = session(keepalive_timeout=self.config.upstream_keepalive_s)
        fresh = session(force_close=True)
        self.poller = HealthPoller(
            self.balancer,
            pooled,
            interval_s=self.config.health_interval_s,
            timeout_s=self.config.health_timeout_s,
            token=self.config.agent_token,
            on_change=self._export_health,
        )
        await self.poller.poll_once()
        self.poller.start()
        self.proxy = self.proxy_class(
            self.store,
            self.balancer,
            self.metrics,
            pooled,
            fresh=fresh,
            api_key=self.config.api_key,
        )
        try:
            yield
        finally:
            self.proxy = None
            await self.poller.stop()
            await pooled.close()
            await fresh.close()

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


def _build_api(router: RouterApp) -> FastAPI:
    cfg = router.config
    app = FastAPI(title="lorafleet router", lifespan=router.lifespan)
    install_error_handlers(app)
    app.add_middleware(JsonBodyLimit, limit=DEFAULT_JSON_LIMIT)
    store, balancer = router.store, router.balancer

    def control(request: Request) -> None:
        require_token(request, cfg.control_token)

    def inference(request: Request) -> None:
        require_token(request, cfg.api_key, what="API key")

    ctl = [Depends(control)]

    @app.get("/health")
    async def health() -> dict:
        healthy = sum(1 for r in balancer.replicas if r.routable)
        return {"status": "ok", "replicas": len(balancer.replicas), "healthy": healthy}

    @app.get("/metrics")
    async def metrics() -> Response:
        router.export_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(inference)])
    async def models() -> dict:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "lorafleet", "root": m}
            for m in sorted(balancer.base_models())
        ]
        parent = data[0]["id"] if data else None
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

    @app.post("/finish_session", dependencies=[Depends(inference)])
    async def finish_session(session_id: str) -> dict:
        """Forget a sticky session (SkyRL calls this when a trajectory ends)."""
        balancer.forget_session(session_id)
        return {"ok": True}

    @app.get("/v1/control/aliases", dependencies=ctl, response_model=AliasTable)
    async def table(log: bool = True) -> AliasTable:
        """``log=false``: the aliases alone (the flip log is up to 10,000 events long)."""
        table = store.table()
        return table if log else AliasTable(aliases=table.aliases, log=[])

    @app.put("/v1/control/aliases/{name}", dependencies=ctl, response_model=AliasEntry)
    async def set_alias(name: str, req: SetAliasRequest) -> AliasEntry:
        kw = {}
        # An explicit null means "no alias yet"; an absent field means "no compare-and-set".
        if "expected_version" in req.model_fields_set:
            kw["expected_version"] = req.expected_version
        entry = store.set_alias(
            name,
            req.version,
            req.engine_name,
            req.replicas,
            lease_holder=req.lease_holder,
            keep_versions=req.keep_versions,
            max_staleness=req.max_staleness,
            sessions=req.sessions,
            **kw,
        )
        router.prune_metrics()
        return entry

    @app.delete("/v1/control/aliases/{name}", dependencies=ctl, status_code=204)
    async def delete_alias(name: str, lease_holder: str | None = None) -> Response:
        store.delete_alias(name, lease_holder)
        router.prune_metrics()
        return Response(status_code=204)

    @app.post("/v1/control/aliases/{name}/drain", dependencies=ctl, response_model=DrainResponse)
    async def drain(name: str, req: DrainRequest) -> DrainResponse:
        active = store.aliases.get(name)
        if active is not None and req.version in {v.version for v in active.window()}:
            raise VersionConflict(
                f"{name!r} v{req.version} is still routable (in the retention window); only a "
                "version that left it can be drained",
                param="version",
            )
        left = await balancer.wait_drained(name, req.version, req.timeout_s)
        router.prune_metrics()
        return DrainResponse(name=name, version=req.version, inflight=left, drained=left == 0)

    @app.post("/v1/control/leases/{name}", dependencies=ctl, response_model=Lease)
    async def acquire_lease(name: str, req: LeaseRequest) -> Lease:
        return store.acquire_lease(name, req.holder, req.ttl_s)

    @app.delete("/v1/control/leases/{name}/{holder}", dependencies=ctl, status_code=204)
    async def release_lease(name: str, holder: str) -> Response:
        store.release_lease(name, holder)
        return Response(status_code=204)

    @app.get("/v1/control/replicas", dependencies=ctl, response_model=ReplicaList)
    async def replicas() -> ReplicaList:
        return ReplicaList(
            replicas=[
                ReplicaStatus(
                    replica_id=r.replica_id or r.agent_url,
                    agent_url=r.agent_url,
                    engine_url=r.engine_url,
                    healthy=r.routable,
                    inflight=r.inflight,
                    detail=r.detail,
                )
                for r in balancer.replicas
            ]
        )

    _document_data_plane(app)
    return app


def _document_data_plane(app: FastAPI) -> None:
    """Add the bare-ASGI routes to /openapi.json (FastAPI never sees them)."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = base()
        body = {"content": {"application/json": {"schema": {"type": "object"}}}}
        ok = {"200": {"description": "The engine's answer, tagged with the version"}}
        for path, summary in (
            ("/v1/completions", "OpenAI completions, routed by adapter version (stream or not)"),
            ("/v1/chat/completions", "OpenAI chat completions, routed by adapter version"),
            ("/generate", "Native token-id generation: {model, token_ids, sampling_params}"),
        ):
            schema["paths"][path] = {
                "post": {"summary": summary, "requestBody": body, "responses": ok}
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def create_app(config: RouterConfig, *, proxy_class: Callable[..., Proxy] = Proxy) -> RouterApp:
    """The router's ASGI app. ``proxy_class``: the data plane (a seam for test doubles)."""
    return RouterApp(config, proxy_class=proxy_class)
