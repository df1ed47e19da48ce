"""Registration by reference (``router/sources.py``): a directory registered as a name's next
version, and a name looked up in the watched directories."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from lorafleet._service import errors, tenant_or_control_guard
from lorafleet.errors import NotFound
from lorafleet.protocol.names import AdapterName
from lorafleet.protocol.router import AliasEntry, RegisterRequest, RegisterResult
from lorafleet.protocol.tenants import Caller
from lorafleet.router.routes import RouteContext

__all__ = ["routes"]


def routes(ctx: RouteContext) -> APIRouter:
    """This group's routes over ``ctx.router``."""
    api = APIRouter()
    router = ctx.router

    # The one control route a tenant's token may call (for its own names).
    guard = tenant_or_control_guard(router.config.control_token, router.config.tenants)

    @api.post(
        "/v1/control/registrations",
        response_model=RegisterResult,
        status_code=201,
        responses={
            200: {"model": RegisterResult, "description": "The newest version has these bytes"},
            **errors(*ctx.guarded, 404, 409, 413, 422),
        },
    )
    async def register(
        req: RegisterRequest, response: Response, caller: Caller = Depends(guard)
    ) -> RegisterResult:
        """Register a PEFT directory as ``name``'s next version without loading it anywhere:
        the router reads its manifest once; a replica copies and verifies it when a request
        places it (docs/placement.md). 201 for a new version; 200 when the name's newest
        version has these bytes already. 403 ``path_not_allowed`` outside ``--source-allow``
        and ``--watch-dir``; 422 ``adapter_invalid``; 409 ``publish_in_progress``, or
        ``tenant_quota_exceeded``. A tenant's token (docs/tenants.md) registers only the
        tenant's own names: any other is 404, as a name that does not exist."""
        if not caller.owns(req.name):
            raise NotFound(f"The model `{req.name}` does not exist.", param="name")
        got = await router.sources.register(req.name, req.path, req.keep_versions)
        response.status_code = 201 if got.created else 200
        return got

    @api.post(
        "/v1/control/aliases/{name}/resolve",
        dependencies=ctx.ctl,
        response_model=AliasEntry,
        responses=errors(*ctx.guarded, 404, 413, 422),
    )
    async def resolve(name: AdapterName) -> AliasEntry:
        """The name's table entry, registering it first from a watched directory that holds a
        subdirectory of that name (what a data-plane copy asks for a name it does not know).
        404 when it is neither in the table nor in a watched directory."""
        if not await router.sources.resolve(name):
            raise NotFound(f"The model `{name}` does not exist.", param="model")
        return router.store.aliases[name]

    return api
