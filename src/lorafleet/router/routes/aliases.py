"""The alias table: flips (compare-and-set), version numbers, deletions and drains."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response

from lorafleet._service import errors
from lorafleet.errors import VersionConflict
from lorafleet.protocol.names import AdapterName, LeaseHolder, Version
from lorafleet.protocol.router import (
    AliasEntry,
    AliasTable,
    DrainRequest,
    DrainResponse,
    Reservation,
    ReserveRequest,
    SetAliasRequest,
    WarmRequest,
    WarmResult,
)
from lorafleet.router.routes import RouteContext, replica_status

__all__ = ["routes"]


def routes(ctx: RouteContext) -> APIRouter:
    """This group's routes over ``ctx.router``."""
    api = APIRouter()
    router = ctx.router
    ctl = ctx.ctl
    guarded = ctx.guarded
    store = ctx.router.store
    balancer = ctx.router.balancer
    known_ids = ctx.known_ids
    check_replicas = ctx.check_replicas

    @api.get(
        "/v1/control/aliases",
        dependencies=ctl,
        response_model=AliasTable,
        responses=errors(400, 401, 403),
    )
    async def table(log: bool = True) -> AliasTable:
        """``log=false``: the aliases alone (the flip log is up to 10,000 events long)."""
        table = store.table()
        return table if log else AliasTable(aliases=table.aliases, log=[])

    @api.put(
        "/v1/control/aliases/{name}",
        dependencies=ctl,
        response_model=AliasEntry,
        responses=errors(*guarded, 409, 413),
    )
    async def set_alias(name: AdapterName, req: SetAliasRequest) -> AliasEntry:
        """The atomic flip, answered once every live data-plane copy acknowledged it (or was
        fenced). 409: ``version_conflict`` (compare-and-set, not newer),
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
        current = store.aliases.get(name)
        # Sessions pinned to the current versions must keep them on every copy.
        pins = current is not None and current.pins_sessions
        async with router.copies.flip(name, pins):
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
                canary=req.canary,
                placement=req.placement,
                size=req.size,
                release_lease=req.release_lease,
                **kw,
            )
        router.placer.listed(name, req.version)
        router.prune_metrics()
        return entry

    @api.post(
        "/v1/control/aliases/{name}/warm",
        dependencies=ctl,
        response_model=WarmResult,
        responses=errors(*guarded, 404, 413, 503),
    )
    async def warm(name: AdapterName, req: WarmRequest) -> WarmResult:
        """Place a cold version (routable, held by no replica in rotation), or with ``more``
        one whose queue grew on one more replica: load it there, evicting the least recently
        used if its engine is full (docs/placement.md).
        Answered once every data-plane copy has the table that lists it. 404 for a name or
        version that is not routable; 503 ``adapter_cold`` (the reason) when it could be loaded
        nowhere."""
        return await router.placer.warm(name, req.version, req.more)

    @api.post(
        "/v1/control/aliases/{name}/reserve",
        dependencies=ctl,
        response_model=Reservation,
        responses=errors(*guarded, 409, 413),
    )
    async def reserve(name: AdapterName, req: ReserveRequest) -> Reservation:
        """The next version number of ``name`` for the lease's holder: above the active one and
        every number handed out before (persisted). With ``lease_ttl_s``, the lease is taken in
        the same write, and the answer carries the name's alias: a publication's plan in one
        round trip. 409 ``version_conflict`` for a number asked for that is not,
        ``publish_in_progress`` for another holder's lease."""
        version = store.reserve(name, req.holder, req.version, lease_ttl_s=req.lease_ttl_s)
        if req.lease_ttl_s is None:
            return Reservation(name=name, version=version, entry=store.aliases.get(name))
        return Reservation(
            name=name,
            version=version,
            entry=store.aliases.get(name),
            replicas=[replica_status(r) for r in balancer.replicas],
        )

    @api.delete(
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

    @api.delete(
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

    @api.post(
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
        deadline = time.monotonic() + req.timeout_s
        left = await balancer.wait_drained(name, req.version, req.timeout_s)
        # ... and on every data-plane copy, in what is left of the timeout.
        left += await router.copies.wait_drained(name, req.version, deadline)
        router.prune_metrics()
        return DrainResponse(name=name, version=req.version, inflight=left, drained=left == 0)

    return api
