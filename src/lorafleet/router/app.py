"""The router application: the bare-ASGI data plane in front of a FastAPI control plane.

``RouterApp`` dispatches the three POST inference routes straight to ``Proxy`` and everything else
(control plane, ``/v1/models``, ``/health``, ``/metrics``, ``/openapi.json``, lifespan) to FastAPI.
The OpenAPI document covers both: FastAPI's routes declare every status they answer, and
``_document_data_plane`` describes the bare-ASGI routes by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated

import aiohttp
import click
from fastapi import Depends, FastAPI, Query, Response
from fastapi import Path as FastAPIPath
from prometheus_client import generate_latest

from lorafleet._service import (
    DEFAULT_JSON_LIMIT,
    METRICS_RESPONSES,
    JsonBodyLimit,
    MetricsResponse,
    describe,
    errors,
    finish_openapi,
    install_error_handlers,
    service_app,
    streamed_ok,
    token_guard,
)
from lorafleet._settings import setting
from lorafleet.errors import InvalidRequest, NotFound, UnknownReplica, VersionConflict
from lorafleet.protocol.agent import check_peer_url
from lorafleet.protocol.errors import STATUS_BY_CODE, ErrorResponse
from lorafleet.protocol.names import AdapterName, LeaseHolder, Version
from lorafleet.protocol.router import (
    MAX_REPLICA_ID,
    AddReplicaRequest,
    AliasEntry,
    AliasTable,
    DrainRequest,
    DrainResponse,
    Lease,
    LeaseRequest,
    MoveReplicaRequest,
    ReplicaList,
    ReplicaStatus,
    Reservation,
    ReserveRequest,
    RouterHealth,
    SetAliasRequest,
)
from lorafleet.protocol.sglang import GenerateRequest
from lorafleet.router import sglang_api
from lorafleet.router.balancer import Balancer, Replica
from lorafleet.router.catchup import CatchUp
from lorafleet.router.health import HealthPoller
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.proxy import DATA_PLANE_ERRORS, MAX_BODY, Proxy
from lorafleet.router.table import AliasStore

__all__ = ["RouterApp", "RouterConfig", "create_app"]

HOT_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/generate", "/inference/v1/generate"}
)

log = logging.getLogger("lorafleet.router")


@dataclass
class RouterConfig:
    agents: list[str]
    control_token: str | None = None
    api_key: str | None = None
    agent_token: str | None = None
    state_dir: str | None = None
    health_interval_s: float = setting(
        0.5, flag="--health-interval", help="Seconds between health probes of each agent."
    )
    health_timeout_s: float = setting(
        5.0, flag="--health-timeout", help="Seconds an agent may take to answer a probe."
    )
    """A busy machine can take seconds to answer a probe; that alone does not drop a replica."""
    unhealthy_after: int = setting(
        3,
        flag="--unhealthy-after",
        type=click.IntRange(min=1),
        help="Consecutive failed probes or requests that take a replica out of rotation.",
    )
    healthy_after: int = setting(
        2,
        flag="--healthy-after",
        type=click.IntRange(min=1),
        help="Consecutive good probes that bring it back.",
    )
    upstream_keepalive_s: float = setting(
        2.0,
        flag="--upstream-keepalive",
        help="Seconds an idle pooled connection to an engine or agent is kept (keep it below the "
        "peers' own keep-alive, 5 s for uvicorn-based servers).",
    )
    catch_up_interval_s: float = setting(
        1.0,
        flag="--catch-up-interval",
        type=click.FloatRange(min=0),
        help="Seconds between catch-up rounds: a replica that lacks a routable version is fed "
        "from a peer that holds it (docs/quorum.md); 0 turns catch-up off.",
    )
    """How often the router compares each replica's adapters with the table and feeds a
    lagging or empty one from a peer (``router/catchup.py``)."""
    """Idle pooled connections to engines and agents are dropped after this: below the 5 s after
    which uvicorn (the reference engine, the agent, vLLM, SGLang) closes them itself."""
    extra: dict = field(default_factory=dict)


class RouterApp:
    """ASGI entry: hot POST routes to the proxy, the rest to FastAPI."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.store = AliasStore(config.state_dir)
        self.balancer = Balancer(
            config.agents,
            unhealthy_after=config.unhealthy_after,
            healthy_after=config.healthy_after,
        )
        self.metrics = RouterMetrics()
        self.proxy: Proxy | None = None
        self.poller: HealthPoller | None = None
        self.catch_up: CatchUp | None = None
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
        if self.config.catch_up_interval_s > 0:
            self.catch_up = CatchUp(
                self.store,
                self.balancer,
                self.metrics,
                token=self.config.agent_token,
                interval_s=self.config.catch_up_interval_s,
                on_change=self.prune_metrics,
            )
            self.catch_up.start()
        self.proxy = Proxy(
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
            if self.catch_up is not None:
                await self.catch_up.stop()
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
        self.metrics.lagging.clear()
        self.metrics.lagging_since.clear()
        for name, e in self.store.aliases.items():
            for rid, lag in e.lagging.items():
                self.metrics.lagging.labels(name, rid).set(1)
                self.metrics.lagging_since.labels(name, rid).set(lag.since_version)


def _status(r: Replica) -> ReplicaStatus:
    return ReplicaStatus(
        replica_id=r.replica_id or r.agent_url,
        agent_url=r.agent_url,
        engine_url=r.engine_url,
        healthy=r.routable,
        inflight=r.inflight,
        detail=r.detail,
    )


def _build_api(router: RouterApp) -> FastAPI:
    cfg = router.config
    app = service_app("lorafleet router", lifespan=router.lifespan)
    install_error_handlers(app)
    app.add_middleware(JsonBodyLimit, limit=DEFAULT_JSON_LIMIT)
    store, balancer = router.store, router.balancer

    ctl = [Depends(token_guard(cfg.control_token))]
    inference = [Depends(token_guard(cfg.api_key, what="API key", scheme="apiKey"))]
    # Every control route: a bad parameter or body (400), no or a wrong token (401, 403).
    guarded = (400, 401, 403)
    # The data plane's /v1/models and /finish_session: the API key, when one is configured.
    keyed = (401, 403) if cfg.api_key is not None else ()

    @app.get("/health", response_model=RouterHealth)
    async def health() -> RouterHealth:
        healthy = sum(1 for r in balancer.replicas if r.routable)
        return RouterHealth(status="ok", replicas=len(balancer.replicas), healthy=healthy)

    @app.get("/metrics", response_class=MetricsResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        router.export_gauges()
        return MetricsResponse(generate_latest(router.metrics.registry))

    def known_ids() -> set[str]:
        return {r.replica_id for r in balancer.replicas if r.replica_id}

    async def check_replicas(ids: list[str]) -> None:
        """Refuse (409 ``unknown_replica``) an alias naming a replica no agent reports."""
        unknown = sorted(set(ids) - known_ids())
        if unknown and router.poller is not None:
            # An agent that was unreachable at the last poll may answer now.
            await router.poller.poll_once()
            unknown = sorted(set(ids) - known_ids())
        if unknown:
            shown = ", ".join(repr(u)[:80] for u in unknown[:5])
            raise UnknownReplica(
                f"unknown replica id(s) {shown}: the router knows {sorted(known_ids())}",
                param="replicas",
            )

    @app.get("/v1/models", dependencies=inference, responses=errors(*keyed))
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

    @app.post("/finish_session", dependencies=inference, responses=errors(400, 413, *keyed))
    async def finish_session(session_id: str) -> dict:
        """Forget a sticky session (SkyRL calls this when a trajectory ends)."""
        balancer.forget_session(session_id)
        return {"ok": True}

    @app.get(
        "/v1/control/aliases",
        dependencies=ctl,
        response_model=AliasTable,
        responses=errors(400, 401, 403),
    )
    async def table(log: bool = True) -> AliasTable:
        """``log=false``: the aliases alone (the flip log is up to 10,000 events long)."""
        table = store.table()
        return table if log else AliasTable(aliases=table.aliases, log=[])

    @app.put(
        "/v1/control/aliases/{name}",
        dependencies=ctl,
        response_model=AliasEntry,
        responses=errors(*guarded, 409, 413),
    )
    async def set_alias(name: AdapterName, req: SetAliasRequest) -> AliasEntry:
        """The atomic flip. 409: ``version_conflict`` (compare-and-set, not newer),
        ``publish_in_progress`` (another lease holder), ``unknown_replica``."""
        await check_replicas(req.replicas)
        # Lagging replicas are reported by id or, for one never reached, its agent URL.
        names = {r.agent_url: r.replica_id or r.agent_url for r in balancer.replicas}
        names.update({i: i for i in known_ids()})
        lagging = {names[k]: v for k, v in req.lagging.items() if k in names}
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
            digest=req.digest,
            lagging=lagging,
            **kw,
        )
        router.prune_metrics()
        return entry

    @app.post(
        "/v1/control/aliases/{name}/reserve",
        dependencies=ctl,
        response_model=Reservation,
        responses=errors(*guarded, 409, 413),
    )
    async def reserve(name: AdapterName, req: ReserveRequest) -> Reservation:
        """The next version number of ``name`` for the lease's holder: above the active one and
        every number handed out before (persisted). 409 ``version_conflict`` for a number asked
        for that is not, ``publish_in_progress`` for another holder's lease."""
        return Reservation(name=name, version=store.reserve(name, req.holder, req.version))

    @app.delete(
        "/v1/control/aliases/{name}/reserve/{version}",
        dependencies=ctl,
        status_code=204,
        response_class=Response,
        responses=errors(*guarded, 409, 413),
    )
    async def release_version(name: AdapterName, version: Version, holder: LeaseHolder) -> Response:
        """Give back the newest number handed out: its attempt reached no engine (idempotent;
        a number that was flipped to, or is not the newest, stays taken)."""
        store.release_version(name, holder, version)
        return Response(status_code=204)

    @app.delete(
        "/v1/control/aliases/{name}",
        dependencies=ctl,
        status_code=204,
        response_class=Response,
        responses=errors(*guarded, 404, 409, 413),
    )
    async def delete_alias(name: AdapterName, lease_holder: LeaseHolder | None = None) -> Response:
        store.delete_alias(name, lease_holder)
        router.prune_metrics()
        return Response(status_code=204)

    @app.post(
        "/v1/control/aliases/{name}/drain",
        dependencies=ctl,
        response_model=DrainResponse,
        responses=errors(*guarded, 409, 413),
    )
    async def drain(name: AdapterName, req: DrainRequest) -> DrainResponse:
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

    @app.post(
        "/v1/control/leases/{name}",
        dependencies=ctl,
        response_model=Lease,
        responses=errors(*guarded, 409, 413),
    )
    async def acquire_lease(name: AdapterName, req: LeaseRequest) -> Lease:
        """Grant or renew the holder's lease; 409 ``publish_in_progress`` if another holds it."""
        return store.acquire_lease(name, req.holder, req.ttl_s)

    @app.delete(
        "/v1/control/leases/{name}/{holder}",
        dependencies=ctl,
        status_code=204,
        response_class=Response,
        responses=errors(*guarded, 409, 413),
    )
    async def release_lease(name: AdapterName, holder: LeaseHolder) -> Response:
        """The holder releases its lease (idempotent); 409 if another holder has it."""
        store.release_lease(name, holder)
        return Response(status_code=204)

    @app.delete(
        "/v1/control/leases/{name}",
        dependencies=ctl,
        status_code=204,
        response_class=Response,
        responses=errors(*guarded, 413),
    )
    async def break_lease(name: AdapterName) -> Response:
        """An operator breaks the lease on ``name``, whoever holds it (idempotent).

        For a publisher that died holding it: its lease would block every publication of the
        name until its TTL. The publisher that held it, if alive, then fails at its flip."""
        broken = store.break_lease(name)
        if broken is not None:
            log.warning("lease on %r held by %r broken by an operator", name, broken.holder)
        return Response(status_code=204)

    @app.get(
        "/v1/control/replicas",
        dependencies=ctl,
        response_model=ReplicaList,
        responses=errors(401, 403),
    )
    async def replicas() -> ReplicaList:
        return ReplicaList(replicas=[_status(r) for r in balancer.replicas])

    @app.put(
        "/v1/control/replicas/{replica_id}",
        dependencies=ctl,
        response_model=ReplicaStatus,
        responses=errors(*guarded, 404, 413),
    )
    async def move_replica(
        replica_id: Annotated[str, FastAPIPath(max_length=MAX_REPLICA_ID)], req: MoveReplicaRequest
    ) -> ReplicaStatus:
        """The replica was re-placed and answers at ``agent_url`` now: polled there, and off
        every version until a publication lists it again (see ``MoveReplicaRequest``)."""
        try:
            url = check_peer_url(req.agent_url)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="agent_url") from None
        found = [r for r in balancer.replicas if replica_id in (r.replica_id, r.agent_url)]
        if not found:
            raise NotFound(
                f"no replica {replica_id[:80]!r}: the router knows {sorted(known_ids())}",
                param="replica_id",
            )
        r = found[0]
        if url == r.agent_url:
            return _status(r)
        taken = [o for o in balancer.replicas if o is not r and o.agent_url == url]
        if taken:
            raise InvalidRequest(
                f"{url} is the agent of replica {taken[0].replica_id or url!r}", param="agent_url"
            )
        was = r.agent_url
        r.replica_id = r.replica_id or replica_id
        names = store.forget_replica(r.replica_id)
        balancer.move(r, url)
        balancer.reindex()
        log.warning(
            "replica %s re-placed: %s -> %s; taken off %d name(s) until republished",
            r.replica_id, was, url, len(names),
        )  # fmt: skip
        return _status(r)

    @app.post(
        "/v1/control/replicas",
        dependencies=ctl,
        status_code=201,
        response_model=ReplicaStatus,
        responses=errors(*guarded, 413),
    )
    async def add_replica(req: AddReplicaRequest) -> ReplicaStatus:
        """A new member: polled from now on, routed nothing until catch-up has fed it each
        routable version from a peer (verified, loaded, proven). The same URL again changes
        nothing (a retry is safe)."""
        try:
            url = check_peer_url(req.agent_url)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="agent_url") from None
        same = [r for r in balancer.replicas if r.agent_url == url]
        if same:
            return _status(same[0])
        r = balancer.add(url)
        if router.poller is not None:
            await router.poller.poll_once()
            router.poller.watch(r)
        log.warning("replica %s added at %s; catch-up feeds it", r.replica_id, url)
        return _status(r)

    @app.delete(
        "/v1/control/replicas/{replica_id}",
        dependencies=ctl,
        response_model=ReplicaStatus,
        responses=errors(*guarded, 404, 413),
    )
    async def remove_replica(
        replica_id: Annotated[str, FastAPIPath(max_length=MAX_REPLICA_ID)],
        drain_s: Annotated[float, Query(ge=0, le=3600)] = 30.0,
    ) -> ReplicaStatus:
        """A member leaves: taken off every version at once (no new request goes there), then
        drained (its requests in flight finish, up to ``drain_s``), then forgotten. Its answer
        says how many requests were still in flight when it was forgotten (0: drained)."""
        found = [r for r in balancer.replicas if replica_id in (r.replica_id, r.agent_url)]
        if not found:
            raise NotFound(
                f"no replica {replica_id[:80]!r}: the router knows {sorted(known_ids())}",
                param="replica_id",
            )
        r = found[0]
        store.forget_replica(r.replica_id or r.agent_url, member=False)
        deadline = time.monotonic() + drain_s
        while r.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        status = _status(r)
        if router.poller is not None:
            await router.poller.unwatch(r)
        balancer.remove(r)
        router.prune_metrics()
        log.warning("replica %s removed (%d in flight)", status.replica_id, status.inflight)
        return status

    app.include_router(sglang_api.routes(router, inference, keyed))
    finish_openapi(app, lambda schema: _document_data_plane(schema, cfg.api_key is not None))
    return app


def _document_data_plane(schema: dict, keyed: bool) -> None:
    """Add the bare-ASGI routes (``Proxy``; FastAPI never sees them) to the OpenAPI document.

    What they answer: 200 with the engine's body, tagged (JSON, or an SSE stream when
    ``stream`` is true); the engine's own error statuses, relayed with engine-side names
    replaced by the alias; and the router's own refusals in the protocol's envelope (400 bad
    body or ``invalid_name``, 401/403 the API key, 404 unknown model, 409 a version staler than
    the alias allows, 413 body over 32 MiB, 502 the engine's answer broke off, 503 no replica):
    ``DATA_PLANE_ERRORS``, each status with its codes.
    """
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    if "ErrorResponse" not in schemas:
        doc = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(doc.pop("$defs", {}))
        schemas["ErrorResponse"] = doc
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    # The engine's own refusals are relayed in its envelope (vLLM: an integer code).
    relayed = {"anyOf": [error, {"type": "object", "required": ["error"]}]}
    model = {
        "type": "string",
        "description": "An adapter name (lorafleet.protocol.names) or a base model's name; "
        "absent: the base model",
    }
    bodies = {
        "/v1/completions": (
            "OpenAI completions, routed by adapter version (stream or not)",
            {"model": model, "prompt": {}, "stream": {"type": "boolean"}},
            ["prompt"],
        ),
        "/v1/chat/completions": (
            "OpenAI chat completions, routed by adapter version (stream or not)",
            {"model": model, "messages": {"type": "array"}, "stream": {"type": "boolean"}},
            ["messages"],
        ),
        "/generate": (
            "Native generation: SkyRL's {model, token_ids, sampling_params}, or SGLang's "
            "{text | input_ids, sampling_params, lora_path, return_logprob, stream, rid, ...} "
            "(router/native.py)",
            {
                "model": model,
                "token_ids": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                "sampling_params": {"type": "object"},
            },
            ["token_ids"],
        ),
        "/inference/v1/generate": (
            "vLLM's native token-in token-out generation, on every engine kind (vLLM's answer "
            "shape): {model, token_ids, sampling_params}",
            {
                "model": model,
                "token_ids": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                "sampling_params": {"type": "object"},
            },
            ["token_ids", "sampling_params"],
        ),
    }
    sglang = GenerateRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    for k, v in sglang.pop("$defs", {}).items():
        schemas.setdefault(k if k != "SamplingParams" else "SGLangSamplingParams", v)
    sglang_ref = {"$ref": "#/components/schemas/SGLangGenerateRequest"}
    schemas["SGLangGenerateRequest"] = json.loads(
        json.dumps(sglang).replace(
            "#/components/schemas/SamplingParams", "#/components/schemas/SGLangSamplingParams"
        )
    )
    own: dict[int, list[str]] = {}
    for cls in DATA_PLANE_ERRORS:
        status = STATUS_BY_CODE[cls.code]
        if keyed or status not in (401, 403):
            own.setdefault(status, []).append(cls.code)
    for path, (summary, props, required) in bodies.items():
        plain = {"type": "object", "properties": props, "required": required}
        ok = streamed_ok(
            "The engine's answer, tagged with the version (a lorafleet field in the JSON body, "
            "or one extra chunk before data: [DONE] in a stream)"
        )
        if path == "/inference/v1/generate":  # one JSON answer: never a stream
            del ok["content"]["text/event-stream"]
        responses: dict = {"200": ok}
        for status in sorted(own):
            why = describe(status, own[status]) + _DATA_PLANE_WHY.get(status, "")
            responses[str(status)] = {
                "description": why,
                "content": {
                    "application/json": {"schema": relayed if status in (400, 404) else error}
                },
            }
        op: dict = {
            "summary": summary,
            "operationId": "data_plane_" + path.strip("/").replace("/", "_"),
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": ({"anyOf": [plain, sglang_ref]} if path == "/generate" else plain)
                    }
                },
            },
            "responses": responses,
        }
        if keyed:
            op["security"] = [{"apiKey": []}]
        schema["paths"][path] = {"post": op}
    if keyed:
        components.setdefault("securitySchemes", {})["apiKey"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "Authorization: Bearer <API key>",
        }


_DATA_PLANE_WHY = {
    400: "; or the engine's own 400, relayed",
    404: " for the model; or the engine's own 404, relayed",
    413: f": the body is over {MAX_BODY >> 20} MiB",
}
"""What the data plane adds to a status's description (the codes come from DATA_PLANE_ERRORS)."""


def create_app(config: RouterConfig) -> RouterApp:
    """The router's ASGI app."""
    return RouterApp(config)
