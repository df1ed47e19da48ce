"""Publication leases: one publisher per name at a time; an operator can break one."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response

from lorafleet._service import errors
from lorafleet.protocol.names import AdapterName, LeaseHolder
from lorafleet.protocol.router import Lease, LeaseRequest
from lorafleet.router.routes import RouteContext

__all__ = ["routes"]

log = logging.getLogger("lorafleet.router")


def routes(ctx: RouteContext) -> APIRouter:
    """This group's routes over ``ctx.router``."""
    api = APIRouter()
    ctl = ctx.ctl
    guarded = ctx.guarded
    store = ctx.router.store

    @api.post(
        "/v1/control/leases/{name}",
        dependencies=ctl,
        response_model=Lease,
        responses=errors(*guarded, 409, 413),
    )
    async def acquire_lease(name: AdapterName, req: LeaseRequest) -> Lease:
        """Grant or renew the holder's lease; 409 ``publish_in_progress`` if another holds it."""
        return store.acquire_lease(name, req.holder, req.ttl_s)

    @api.delete(
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

    @api.delete(
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

    return api
