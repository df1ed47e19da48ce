"""The agent's HTTP surface: FastAPI routes over the upload manager and the adapter service.

Mutating routes need the control token; ``/health``, ``/v1/info``, ``/metrics`` and the OpenAPI
document are open. JSON bodies are capped by ``JsonBodyLimit`` before FastAPI parses them; the
upload PUT streams its raw body and is capped by the declared file size instead. Every route
documents each status it answers (``responses=``); nothing a client sends is answered with a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import click
from fastapi import Depends, FastAPI, Header, Request, Response, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from prometheus_client import generate_latest
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_fixed

from lorafleet._service import (
    DEFAULT_JSON_LIMIT,
    METRICS_RESPONSES,
    JsonBodyLimit,
    MetricsResponse,
    check_token,
    errors,
    finish_openapi,
    install_error_handlers,
    service_app,
    token_guard,
)
from lorafleet._settings import setting
from lorafleet.agent.adapters import AdapterService
from lorafleet.agent.backends import EngineBackend, EngineUnavailable, make_backend
from lorafleet.agent.limits import UploadLimits
from lorafleet.agent.metrics import Metrics
from lorafleet.agent.probe import ApplicationProbe
from lorafleet.agent.reconcile import Reconciler
from lorafleet.agent.relay import send_file
from lorafleet.agent.state import StateDB
from lorafleet.agent.store import Store
from lorafleet.agent.uploads import UploadManager
from lorafleet.engine_kinds import EngineKind
from lorafleet.protocol.agent import (
    CONTENT_DIGEST_HEADER,
    REPR_DIGEST_HEADER,
    UPLOAD_OFFSET_HEADER,
    ActivateRequest,
    AdapterList,
    AdapterRecord,
    AgentInfo,
    EngineCapabilities,
    FileProgress,
    ForwardPlan,
    Health,
    LoadRequest,
    Manifest,
    OpenUploadRequest,
    RegisterPathRequest,
    SendRequest,
    SendResult,
    UnloadRequest,
    UploadSession,
    UploadStatus,
    VerifyRequest,
)
from lorafleet.protocol.names import AdapterName, Version

__all__ = ["AgentConfig", "create_app"]

log = logging.getLogger("lorafleet.agent")


@dataclass
class AgentConfig:
    engine: EngineKind
    engine_url: str
    data_dir: str
    token: str | None
    replica_id: str
    served_model_name: str | None = setting(
        None, flag="--served-model-name", help="Default: discovered from the engine."
    )
    limits: UploadLimits = field(default_factory=UploadLimits)
    shared_fs_allow: list[str] = setting(
        flag="--shared-fs-allow",
        multiple=True,
        type=click.Path(),
        default_factory=list,
        help="Directory /v1/adapters/register may read from (repeatable).",
    )
    max_lora_rank: int | None = setting(
        None, flag="--max-lora-rank", type=int, help="Override the engine's limit."
    )
    max_adapters: int | None = setting(
        None, flag="--max-adapters", type=int, help="Override the engine's limit."
    )
    engine_options: dict[str, bool] = field(default_factory=dict)
    """The engine kind's own flags by key (``lorafleet.engine_kinds``: sglang_upsert)."""
    reconcile_interval: float = 0.5
    json_limit: int = DEFAULT_JSON_LIMIT


class Runtime:
    """Everything one agent process holds, built at startup and torn down at shutdown."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.store = Store(cfg.data_dir)
        removed = self.store.clear_staging()
        if removed:
            log.info("removed %d stale staging entries", removed)
        self.db = StateDB(self.store.root / "state.db")
        swept = self.store.sweep({(i.record.name, i.record.version) for i in self.db.all()})
        if swept:
            log.info("removed %d orphaned adapter directories and blobs", swept)
        self.store.blob_bytes()  # count once now; kept up to date from here on
        self.uploads = UploadManager(self.store, cfg.limits, self.metrics)
        self.backend: EngineBackend = make_backend(
            cfg.engine,
            cfg.engine_url,
            max_lora_rank=cfg.max_lora_rank,
            max_adapters=cfg.max_adapters,
            options=cfg.engine_options,
        )
        self.caps = EngineCapabilities(kind=cfg.engine)
        self.base_model = cfg.served_model_name or "unknown"
        self.probed = False
        self.probe_detail: str | None = "engine not probed yet"
        self.service = AdapterService(
            self.store,
            self.db,
            self.uploads,
            self.backend,
            self.caps,
            self.metrics,
            cfg.shared_fs_allow,
        )
        self.reconciler = Reconciler(self.service, cfg.reconcile_interval)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._probe_until_ok(), name="probe"))
        self._tasks.append(asyncio.create_task(self._reap_forever(), name="reaper"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.reconciler.stop()
        await self.uploads.aclose_relay()
        await self.backend.aclose()
        self.db.close()

    async def _probe_until_ok(self) -> None:
        """Probe the engine until it answers; a garbled answer must not end probing for good."""

        def note(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, EngineUnavailable):
                self.probe_detail = str(exc)
            else:
                log.warning("engine probe failed: %s: %s", type(exc).__name__, exc)
                self.probe_detail = f"engine probe failed: {type(exc).__name__}: {exc}"

        retrying = AsyncRetrying(
            wait=wait_fixed(0.5), retry=retry_if_exception_type(Exception), before_sleep=note
        )
        probe = await retrying(self.backend.probe)
        self.caps = probe.capabilities
        self.service.caps = probe.capabilities
        if not self.cfg.served_model_name:
            self.base_model = probe.base_model
        self.service.probe = ApplicationProbe(self.backend.http, self.caps.kind, self.base_model)
        # The base model's logprobs, measured now: a vLLM server's first prompt-logprobs
        # request can take tens of seconds, which belongs to startup, not to a publication.
        self._tasks.append(asyncio.create_task(self._warm_probe(), name="probe-baseline"))
        self.probed = True
        self.probe_detail = None
        self.reconciler.start()

    async def _warm_probe(self) -> None:
        try:
            await self.service.probe.baseline()
        except Exception as exc:  # measured again on the first check
            log.warning("application probe baseline failed: %s", exc)

    async def _reap_forever(self) -> None:
        period = max(0.2, min(self.cfg.limits.ttl_s / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            try:
                await self.uploads.areap()
            except Exception:
                log.exception("reaping uploads failed")

    def health(self) -> Health:
        rec = self.reconciler
        if not self.probed:
            return Health(
                status="not_ready",
                engine_reachable=False,
                reconciling=True,
                detail=self.probe_detail,
            )
        return Health(
            status="ok" if rec.ready else "not_ready",
            engine_reachable=rec.engine_reachable,
            reconciling=rec.pending,
            detail=rec.detail,
        )


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

    # --- uploads ---------------------------------------------------------------------------

    @app.post(
        "/v1/uploads",
        status_code=201,
        dependencies=guard,
        responses=errors(*ctl, 409, 413, 503, 507),
    )
    async def open_upload(req: OpenUploadRequest) -> UploadSession:
        """Open an upload; refuses over-cap files, quota, bad paths and stale versions at once.
        With ``relay``, peers presenting the publication's credential may PUT its files."""
        return await rt.service.open_upload(req.manifest, supersede=req.supersede, relay=req.relay)

    @app.post("/v1/uploads/{upload_id}/forward", dependencies=guard, responses=errors(*ctl, 404))
    async def forward(upload_id: str, plan: ForwardPlan) -> UploadStatus:
        """Relay: forward these files to these peers' sessions while they stream in (each file
        from its first byte, once). Refuses a path this session is not about to receive."""
        return rt.uploads.set_forward(upload_id, plan)

    @app.get("/v1/uploads/{upload_id}", dependencies=guard, responses=errors(*ctl, 404))
    async def upload_status(upload_id: str) -> UploadStatus:
        return rt.uploads.status(upload_id)

    @app.head(
        "/v1/uploads/{upload_id}/files/{path:path}",
        response_class=Response,
        responses={
            200: {
                "description": "The durable offset, in the Upload-Offset header (no body)",
                "headers": {
                    UPLOAD_OFFSET_HEADER: {"required": True, "schema": {"type": "integer"}}
                },
            },
            **errors(*ctl, 404),
        },
    )
    async def upload_offset(
        upload_id: str, path: str, _peer: bool = Depends(upload_access)
    ) -> Response:
        """The durable offset of one file, in the Upload-Offset header."""
        off = rt.uploads.offset(upload_id, path)
        return Response(status_code=200, headers={UPLOAD_OFFSET_HEADER: str(off)})

    @app.put(
        "/v1/uploads/{upload_id}/files/{path:path}",
        responses=errors(*ctl, 404, 408, 409, 413, 422, 507),
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "Raw file bytes, starting at Upload-Offset.",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def upload_file(
        request: Request,
        upload_id: str,
        path: str,
        upload_offset: int | None = Header(
            None, alias=UPLOAD_OFFSET_HEADER, ge=0, description="Resume from this byte offset."
        ),
        repr_digest: str | None = Header(
            None, alias=REPR_DIGEST_HEADER, description="RFC 9530: sha-256 of the whole file."
        ),
        content_digest: str | None = Header(
            None, alias=CONTENT_DIGEST_HEADER, description="RFC 9530: sha-256 of this body."
        ),
        peer: bool = Depends(upload_access),
    ) -> FileProgress:
        """Stream one file's bytes; verified against the manifest's size and sha256."""
        # The transport's own header (HTTP framing has already checked it), not a parameter.
        declared = request.headers.get("content-length")
        content_length = int(declared) if declared and declared.isdigit() else None
        return await rt.uploads.put(
            upload_id,
            path,
            request.stream(),
            offset=upload_offset,
            content_length=content_length,
            repr_digest=repr_digest,
            content_digest=content_digest,
            peer=peer,
        )

    @app.post(
        "/v1/uploads/{upload_id}/commit",
        dependencies=guard,
        responses=errors(*ctl, 404, 409, 413, 422, 503, 507),
    )
    async def commit(upload_id: str) -> AdapterRecord:
        return await rt.service.commit(upload_id)

    @app.delete(
        "/v1/uploads/{upload_id}",
        status_code=204,
        dependencies=guard,
        response_class=Response,
        responses=errors(*ctl, 404, 413),
    )
    async def discard(upload_id: str) -> Response:
        rt.uploads.get(upload_id)
        await rt.uploads.aclose(upload_id, keep_blobs=False)
        return Response(status_code=204)

    # --- adapters --------------------------------------------------------------------------

    @app.post(
        "/v1/adapters/register",
        dependencies=guard,
        responses=errors(*ctl, 409, 413, 422, 503, 507),
    )
    async def register(req: RegisterPathRequest) -> AdapterRecord:
        return await rt.service.register(req.manifest, req.path, supersede=req.supersede)

    @app.post(
        "/v1/adapters/load",
        dependencies=guard,
        responses=errors(*ctl, 404, 409, 413, 422, 502, 503, 507),
    )
    async def load(req: LoadRequest) -> AdapterRecord:
        return await rt.service.load(req.name, req.version, req.mode)

    @app.post(
        "/v1/adapters/verify",
        dependencies=guard,
        responses=errors(*ctl, 404, 409, 413, 502, 503),
    )
    async def verify(req: VerifyRequest) -> AdapterRecord:
        """Check that the engine applies the loaded version, addressed as the router will; 502
        ``adapter_not_applied`` if it answers as the base model."""
        return await rt.service.verify(req.name, req.version)

    @app.post(
        "/v1/adapters/activate", dependencies=guard, responses=errors(*ctl, 404, 409, 413, 503)
    )
    async def activate(req: ActivateRequest) -> AdapterRecord:
        return await rt.service.activate(req.name, req.version)

    @app.post("/v1/adapters/unload", dependencies=guard, responses=errors(*ctl, 404, 409, 413, 503))
    async def unload(req: UnloadRequest) -> AdapterRecord:
        """Gone from engine and store. 503 ``engine_unavailable`` when the engine does not
        answer: the record is then ``retiring`` and the agent finishes once it answers."""
        return await rt.service.unload(req.name, req.version)

    @app.get(
        "/v1/adapters/{name}/{version}/manifest",
        dependencies=guard,
        responses=errors(*ctl, 404),
    )
    async def adapter_manifest(name: AdapterName, version: Version) -> Manifest:
        """The manifest of a version loaded here: what a lagging peer opens its session with."""
        return rt.service.stored(name, version)[0]

    @app.post("/v1/adapters/send", dependencies=guard, responses=errors(*ctl, 404, 413))
    async def send(req: SendRequest) -> SendResult:
        """Catch-up: PUT a loaded version's files (verified when they came in) into a peer's
        session, presenting ``credential``; the peer verifies each as any upload."""
        manifest, root = rt.service.stored(req.name, req.version)
        wanted = set(req.paths) if req.paths is not None else None
        hops, sent = [], 0
        for entry in manifest.files:
            if wanted is not None and entry.path not in wanted:
                continue
            hop, n = await send_file(
                rt.uploads.relay_http(),
                req.target,
                entry,
                str(root / entry.path),
                req.credential,
                req.stall_s,
            )
            hops.append(hop)
            sent += n
            if not hop.ok:
                break
        return SendResult(hops=hops, bytes_sent=sent)

    @app.get("/v1/adapters")
    async def list_adapters() -> AdapterList:
        return AdapterList(adapters=rt.service.list())

    # --- open endpoints --------------------------------------------------------------------

    @app.get("/v1/info")
    async def info() -> AgentInfo:
        return AgentInfo(
            replica_id=cfg.replica_id,
            engine_url=cfg.engine_url,
            base_model=rt.base_model,
            capabilities=rt.caps,
            ready=rt.health().status == "ok",
        )

    @app.get("/health", responses={503: {"model": Health, "description": "Not ready"}})
    async def health() -> JSONResponse:
        h = rt.health()
        return JSONResponse(h.model_dump(), status_code=200 if h.status == "ok" else 503)

    @app.get("/metrics", response_class=MetricsResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        with contextlib.suppress(OSError):
            rt.metrics.store_bytes.set(await asyncio.to_thread(rt.store.usage))
        return MetricsResponse(generate_latest(rt.metrics.registry))

    finish_openapi(app)
    return app
