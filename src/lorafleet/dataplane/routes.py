"""The data plane's FastAPI routes (the hot generation paths are the pipeline's, not these).

    GET  /v1/models                        the base models and every alias by its public name
    POST /finish_session?session_id=       forget a sticky session (SkyRL ends a trajectory)
    GET  /workers                          -> WorkerList (sglang-router's; each url is the
                                              router's own per-replica address)
    GET  /list_workers                     -> {"urls": [...]} (older sglang-router)
    POST /abort_request                    AbortRequest -> 200, empty (every replica)
    POST /workers/{id}/abort_request       AbortRequest -> 200, empty (that replica)
    GET  /v1/loads, /workers/{id}/v1/loads -> the requests in flight there

The inference key guards them when one is configured (Miles and slime call the sglang-router
ones from the rollout side, with the same credentials as ``/generate``). With tenants, a tenant's
token is accepted too: ``/v1/models`` lists only its names (and the base models), and aborting
everything (``abort_all``) stays the operator's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as FastAPIPath

from lorafleet._service import errors
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.plane import DataPlane
from lorafleet.errors import Forbidden, NotFound
from lorafleet.protocol.router import MAX_REPLICA_ID
from lorafleet.protocol.sglang import AbortRequest, WorkerInfo, WorkerList
from lorafleet.protocol.tenants import Caller

__all__ = ["routes", "worker_list"]

ReplicaId = Annotated[str, FastAPIPath(max_length=MAX_REPLICA_ID)]


def _rid(r: Replica) -> str:
    return r.replica_id or r.agent_url


def worker_list(replicas: list[Replica], base_url: str) -> WorkerList:
    """``GET /workers``: every replica, with the data plane's own per-replica URL."""
    base = base_url.rstrip("/")
    workers = [
        WorkerInfo(
            id=_rid(r),
            url=f"{base}/workers/{quote(_rid(r), safe='')}",
            model_id=r.base_model,
            is_healthy=r.routable,
            load=r.inflight,
            engine_kind=r.kind,
        )
        for r in replicas
    ]
    n = len(workers)
    return WorkerList(
        workers=workers,
        total=n,
        stats={"prefill_count": 0, "decode_count": 0, "regular_count": n},
    )


def _load(replicas: list[Replica]) -> dict[str, Any]:
    """SGLang's ``/v1/loads`` fields that Miles and slime read (``num_reqs`` first)."""
    return {
        "num_reqs": sum(r.inflight for r in replicas),
        "loads": [
            {
                "dp_rank": 0,
                "worker": _rid(r),
                "num_running_reqs": r.inflight,
                "num_waiting_reqs": 0,
            }
            for r in replicas
        ],
    }


def routes(plane: DataPlane, guard: Callable[..., Caller], keyed: tuple[int, ...]) -> APIRouter:
    """The routes over ``plane``, guarded by ``guard`` (``_service.inference_guard``: the
    inference key, or a tenant's token)."""
    who = Depends(guard)  # one call per request: the router-wide dependency's result
    api = APIRouter(dependencies=[who])
    balancer = plane.balancer

    def one(replica_id: str) -> Replica:
        for r in balancer.replicas:
            if replica_id in (r.replica_id, r.agent_url):
                return r
        known = sorted(_rid(r) for r in balancer.replicas)
        raise NotFound(f"no worker {replica_id[:80]!r}: the router has {known}", param="id")

    async def abort(req: AbortRequest, replicas: list[Replica] | None, caller: Caller) -> Response:
        if req.abort_all and not caller.is_operator:
            # Every request on the replicas, other tenants' too.
            raise Forbidden("abort_all is the operator's: a tenant aborts its own requests by rid")
        await plane.abort(req.rid, req.abort_all, replicas)
        return Response(status_code=200)

    @api.get("/v1/models", responses=errors(*keyed))
    async def models(caller: Caller = who) -> dict:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "lorafleet", "root": m}
            for m in sorted(balancer.base_models())
        ]
        parent = data[0]["id"] if data else None
        # Aliases by their public names only: engine-side names (policy@v3) stay inside.
        for name, e in sorted(plane.table.aliases.items()):
            if not caller.owns(name):
                continue
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

    @api.post("/finish_session", responses=errors(400, 413, *keyed))
    async def finish_session(session_id: str) -> dict:
        """Forget a sticky session (SkyRL calls this when a trajectory ends)."""
        await plane.finish_session(session_id)
        return {"ok": True}

    @api.get("/workers", response_model=WorkerList, responses=errors(*keyed))
    async def workers(request: Request) -> WorkerList:
        return worker_list(balancer.replicas, str(request.base_url))

    @api.get("/list_workers", responses=errors(*keyed))
    async def list_workers(request: Request) -> dict:
        listed = worker_list(balancer.replicas, str(request.base_url))
        return {"urls": [w.url for w in listed.workers]}

    @api.post(
        "/abort_request",
        response_class=Response,
        responses={
            200: {"description": "Aborted (an empty body, as SGLang's)"},
            **errors(400, 403, 413, *keyed),
        },
    )
    async def abort_all_replicas(req: AbortRequest, caller: Caller = who) -> Response:
        """Abort ``rid`` (or, with ``abort_all``, everything) on every replica."""
        return await abort(req, None, caller)

    @api.post(
        "/workers/{replica_id}/abort_request",
        response_class=Response,
        responses={
            200: {"description": "Aborted (an empty body)"},
            **errors(400, 403, 404, 413, *keyed),
        },
    )
    async def abort_one(replica_id: ReplicaId, req: AbortRequest, caller: Caller = who) -> Response:
        return await abort(req, [one(replica_id)], caller)

    @api.get("/v1/loads", responses=errors(*keyed))
    async def loads() -> dict:
        return _load(balancer.replicas)

    @api.get("/workers/{replica_id}/v1/loads", responses=errors(400, 404, *keyed))
    async def loads_one(replica_id: ReplicaId) -> dict:
        return _load([one(replica_id)])

    return api
