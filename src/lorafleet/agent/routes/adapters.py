"""Adapters: register from a shared path, load, verify, activate, unload, send to a peer, list."""

from __future__ import annotations

from fastapi import APIRouter

from lorafleet._service import errors
from lorafleet.agent.relay import send_file
from lorafleet.agent.routes import AgentRoutes
from lorafleet.errors import InvalidRequest, NotFound
from lorafleet.protocol.agent import (
    ActivateRequest,
    AdapterList,
    AdapterRecord,
    BlobSendRequest,
    LoadRequest,
    Manifest,
    RegisterPathRequest,
    SendRequest,
    SendResult,
    UnloadRequest,
    VerifyRequest,
)
from lorafleet.protocol.canary import Canary
from lorafleet.protocol.names import AdapterName, Version

__all__ = ["routes"]


def routes(ctx: AgentRoutes) -> APIRouter:
    """This group's routes over ``ctx.rt``."""
    api = APIRouter()
    rt = ctx.rt
    guard = ctx.guard
    ctl = ctx.ctl

    @api.post(
        "/v1/adapters/register",
        dependencies=guard,
        responses=errors(*ctl, 409, 413, 422, 503, 507),
    )
    async def register(req: RegisterPathRequest) -> AdapterRecord:
        return await rt.service.register(req.manifest, req.path, supersede=req.supersede)

    @api.post(
        "/v1/adapters/load",
        dependencies=guard,
        responses=errors(*ctl, 404, 409, 413, 422, 502, 503, 507),
    )
    async def load(req: LoadRequest) -> AdapterRecord:
        return await rt.service.load(req.name, req.version, req.mode)

    @api.post(
        "/v1/adapters/verify",
        dependencies=guard,
        responses=errors(*ctl, 404, 409, 413, 502, 503),
    )
    async def verify(req: VerifyRequest) -> AdapterRecord:
        """Check that the engine applies the loaded version, addressed as the router will; 502
        ``adapter_not_applied`` if it answers as the base model, 502 ``canary_mismatch`` if it
        answers the trainer's ``canary`` otherwise than the trainer did."""
        return await rt.service.verify(req.name, req.version, req.canary)

    @api.post(
        "/v1/adapters/activate", dependencies=guard, responses=errors(*ctl, 404, 409, 413, 503)
    )
    async def activate(req: ActivateRequest) -> AdapterRecord:
        return await rt.service.activate(req.name, req.version)

    @api.post("/v1/adapters/unload", dependencies=guard, responses=errors(*ctl, 404, 409, 413, 503))
    async def unload(req: UnloadRequest) -> AdapterRecord:
        """Gone from engine and store. 503 ``engine_unavailable`` when the engine does not
        answer: the record is then ``retiring`` and the agent finishes once it answers."""
        return await rt.service.unload(req.name, req.version)

    @api.post("/v1/adapters/evict", dependencies=guard, responses=errors(*ctl, 404, 409, 413, 503))
    async def evict(req: UnloadRequest) -> AdapterRecord:
        """Out of the engine, its verified files kept (``staged``): a later load needs no
        bytes. 409 for a version loaded in place; 503 when the engine does not answer."""
        return await rt.service.evict(req.name, req.version)

    @api.get(
        "/v1/adapters/{name}/{version}/manifest",
        dependencies=guard,
        responses=errors(*ctl, 404),
    )
    async def adapter_manifest(name: AdapterName, version: Version) -> Manifest:
        """The manifest of a version loaded here: what a lagging peer opens its session with."""
        return rt.service.stored(name, version)[0]

    @api.get(
        "/v1/adapters/{name}/{version}/canary",
        dependencies=guard,
        responses=errors(*ctl, 404),
    )
    async def adapter_canary(name: AdapterName, version: Version) -> Canary | None:
        """The trainer's canary a version held here was proven with (null: proven without
        one): a lagging peer's copy is proven by the same one."""
        return rt.service.canary(name, version)

    @api.post("/v1/adapters/send", dependencies=guard, responses=errors(*ctl, 404, 413))
    async def send(req: SendRequest) -> SendResult:
        """Catch-up: PUT a loaded version's files (verified when they came in) into a peer's
        session, presenting ``credential``; the peer verifies each as any upload."""
        manifest, root = rt.service.stored(req.name, req.version)
        wanted = set(req.paths) if req.paths is not None else None
        hops, relayed, sent = [], [], 0
        for entry in manifest.files:
            if wanted is not None and entry.path not in wanted:
                continue
            hop, n, more = await send_file(
                rt.uploads.relay_http(),
                req.target,
                entry,
                str(root / entry.path),
                req.credential,
                req.stall_s,
            )
            hops.append(hop)
            relayed.extend(more)
            sent += n
            if not hop.ok:
                break
        return SendResult(hops=hops, bytes_sent=sent, relayed=relayed)

    @api.post("/v1/blobs/send", dependencies=guard, responses=errors(*ctl, 404, 413))
    async def send_blob(req: BlobSendRequest) -> SendResult:
        """Relay repair: PUT one verified file this agent holds (by sha-256; a file of an open
        upload session counts once verified) into a peer's session from ``offset``, so that a
        dead hop's subtree is fed by a live replica and not by the trainer again."""
        entry = req.entry
        if req.offset > entry.size:
            raise InvalidRequest(f"offset {req.offset} is past the file's {entry.size} bytes")
        if not rt.store.has_blob(entry.sha256, entry.size):
            raise NotFound(f"no verified copy of {entry.path} ({entry.sha256[:12]}) here")
        hop, sent, relayed = await send_file(
            rt.uploads.relay_http(),
            req.target,
            entry,
            str(rt.store.blob_path(entry.sha256)),
            req.credential,
            req.stall_s,
            offset=req.offset,
        )
        return SendResult(hops=[hop], bytes_sent=sent, relayed=relayed)

    @api.get("/v1/adapters")
    async def list_adapters() -> AdapterList:
        return AdapterList(adapters=rt.service.list())

    return api
