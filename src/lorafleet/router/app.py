"""The router application: the bare-ASGI data plane in front of a FastAPI control plane.

``RouterApp`` dispatches the three POST inference routes straight to ``Proxy`` and everything else
(control plane, ``/v1/models``, ``/health``, ``/metrics``, ``/openapi.json``, lifespan) to FastAPI.
The OpenAPI document covers both: FastAPI's routes declare every status they answer, and
``_document_data_plane`` describes the bare-ASGI routes by hand.
"""

from __future__ import annotations

import contextlib
import json
import logging

import aiohttp
from fastapi import Depends, FastAPI

from lorafleet._service import (
    DEFAULT_JSON_LIMIT,
    JsonBodyLimit,
    describe,
    finish_openapi,
    install_error_handlers,
    service_app,
    streamed_ok,
    token_guard,
)
from lorafleet.protocol.errors import STATUS_BY_CODE, ErrorResponse
from lorafleet.protocol.sglang import GenerateRequest
from lorafleet.router import sglang_api
from lorafleet.router.balancer import Balancer
from lorafleet.router.catchup import CatchUp
from lorafleet.router.config import RouterConfig
from lorafleet.router.health import HealthPoller
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.proxy import DATA_PLANE_ERRORS, MAX_BODY, Proxy
from lorafleet.router.routes import RouteContext, aliases, leases, reads, replicas
from lorafleet.router.table import AliasStore

__all__ = ["RouterApp", "RouterConfig", "create_app"]

HOT_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/generate", "/inference/v1/generate"}
)

log = logging.getLogger("lorafleet.router")


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


def _build_api(router: RouterApp) -> FastAPI:
    cfg = router.config
    app = service_app("lorafleet router", lifespan=router.lifespan)
    install_error_handlers(app)
    app.add_middleware(JsonBodyLimit, limit=DEFAULT_JSON_LIMIT)

    ctl = [Depends(token_guard(cfg.control_token))]
    inference = [Depends(token_guard(cfg.api_key, what="API key", scheme="apiKey"))]
    # Every control route: a bad parameter or body (400), no or a wrong token (401, 403).
    guarded = (400, 401, 403)
    # The data plane's /v1/models and /finish_session: the API key, when one is configured.
    keyed = (401, 403) if cfg.api_key is not None else ()

    ctx = RouteContext(router, ctl, inference, guarded, keyed)
    for group in (reads, aliases, leases, replicas):
        app.include_router(group.routes(ctx))
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
