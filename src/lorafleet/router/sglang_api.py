"""The router's sglang-router control routes (FastAPI glue; the logic is router/native.py).

    GET  /workers                          -> WorkerList (each url is the router's own
                                              per-replica address)
    GET  /list_workers                     -> {"urls": [...]} (older sglang-router)
    POST /abort_request                    AbortRequest -> 200, empty (every replica)
    POST /workers/{id}/abort_request       AbortRequest -> 200, empty (that replica)
    GET  /v1/loads, /workers/{id}/v1/loads -> the requests the router has in flight there

They sit on the data plane: the inference key guards them when one is configured (Miles and
slime call them from the rollout side, with the same credentials as ``/generate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi import Path as FastAPIPath

from lorafleet._service import errors
from lorafleet.errors import NotFound
from lorafleet.protocol.router import MAX_REPLICA_ID
from lorafleet.protocol.sglang import AbortRequest, WorkerList
from lorafleet.router.balancer import Replica
from lorafleet.router.native import worker_list

if TYPE_CHECKING:
    from lorafleet.router.app import RouterApp

__all__ = ["routes"]

ReplicaId = Annotated[str, FastAPIPath(max_length=MAX_REPLICA_ID)]


def _load(replicas: list[Replica]) -> dict[str, Any]:
    """SGLang's ``/v1/loads`` fields that Miles and slime read (``num_reqs`` first)."""
    n = sum(r.inflight for r in replicas)
    return {
        "num_reqs": n,
        "loads": [
            {
                "dp_rank": 0,
                "worker": r.replica_id or r.agent_url,
                "num_running_reqs": r.inflight,
                "num_waiting_reqs": 0,
            }
            for r in replicas
        ],
    }


def routes(router: RouterApp, dependencies: list, keyed: tuple[int, ...]) -> APIRouter:
    """The routes, guarded by ``dependencies`` (the inference key)."""
    api = APIRouter(dependencies=dependencies)
    balancer = router.balancer

    def one(replica_id: str) -> Replica:
        for r in balancer.replicas:
            if replica_id in (r.replica_id, r.agent_url):
                return r
        known = sorted(r.replica_id or r.agent_url for r in balancer.replicas)
        raise NotFound(f"no worker {replica_id[:80]!r}: the router has {known}", param="id")

    async def abort(req: AbortRequest, replicas: list[Replica] | None) -> Response:
        if router.proxy is not None:
            await router.proxy.native.abort(req.rid, req.abort_all, replicas)
        return Response(status_code=200)

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
            **errors(400, 413, *keyed),
        },
    )
    async def abort_all_replicas(req: AbortRequest) -> Response:
        """Abort ``rid`` (or, with ``abort_all``, everything) on every replica."""
        return await abort(req, None)

    @api.post(
        "/workers/{replica_id}/abort_request",
        response_class=Response,
        responses={
            200: {"description": "Aborted (an empty body)"},
            **errors(400, 404, 413, *keyed),
        },
    )
    async def abort_one(replica_id: ReplicaId, req: AbortRequest) -> Response:
        return await abort(req, [one(replica_id)])

    @api.get("/v1/loads", responses=errors(*keyed))
    async def loads() -> dict:
        return _load(balancer.replicas)

    @api.get("/workers/{replica_id}/v1/loads", responses=errors(400, 404, *keyed))
    async def loads_one(replica_id: ReplicaId) -> dict:
        return _load([one(replica_id)])

    return api
