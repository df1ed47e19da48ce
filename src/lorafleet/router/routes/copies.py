"""The data-plane copies' routes: their sync (a long poll), pins during a flip, their status."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from lorafleet._service import errors
from lorafleet.protocol.names import AdapterName
from lorafleet.protocol.router import CopyList, CopyReport, PinRecord, PinRequest, Snapshot
from lorafleet.router.routes import RouteContext

__all__ = ["routes"]


def routes(ctx: RouteContext) -> APIRouter:
    """This group's routes over ``ctx.router.copies``."""
    api = APIRouter()
    copies = ctx.router.copies

    @api.post(
        "/v1/control/sync",
        dependencies=ctx.ctl,
        response_model=Snapshot,
        responses=errors(*ctx.guarded, 413),
    )
    async def sync(
        report: CopyReport, wait: Annotated[float, Query(ge=0, le=30)] = 1.0
    ) -> Snapshot:
        """A data-plane copy's long poll: its report (the seq it applied acknowledges that
        flip) in; the table out, at once when it changed for this copy, else after ``wait``
        seconds (a heartbeat that renews the copy's lease)."""
        return await copies.sync(report, wait)

    @api.post(
        "/v1/control/pins",
        dependencies=ctx.ctl,
        response_model=PinRecord,
        responses=errors(*ctx.guarded, 413),
    )
    async def pin(req: PinRequest) -> PinRecord:
        """The session's pin on ``name`` (made now on the newest version if it has none): a copy
        asks while a flip of ``name`` is under way."""
        name: AdapterName = req.name
        return copies.pin(req.session, name)

    @api.get(
        "/v1/control/copies",
        dependencies=ctx.ctl,
        response_model=CopyList,
        responses=errors(401, 403),
    )
    async def status() -> CopyList:
        """Every live data-plane copy: the table seq it routes by, whether it is current or
        fenced, its in-flight requests."""
        return copies.status()

    return api
