"""Membership: the replicas the router knows, a re-placed one's new address, joins and leaves."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi import Path as FastAPIPath

from lorafleet._service import errors
from lorafleet.dataplane.balancer import Replica
from lorafleet.errors import InvalidRequest, NotFound
from lorafleet.protocol.agent import check_peer_url
from lorafleet.protocol.router import (
    MAX_REPLICA_ID,
    AddReplicaRequest,
    CatchUpList,
    CatchUpTree,
    MoveReplicaRequest,
    ReplicaList,
    ReplicaStatus,
    RoomRequest,
    RoomResult,
)
from lorafleet.router.routes import RouteContext, replica_status

__all__ = ["routes"]

log = logging.getLogger("lorafleet.router")


def peer_url(url: str) -> str:
    """An agent URL the router may call (``check_peer_url``); ``InvalidRequest`` (400) if not."""
    try:
        return check_peer_url(url)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="agent_url") from None


def routes(ctx: RouteContext) -> APIRouter:
    """This group's routes over ``ctx.router``."""
    api = APIRouter()
    router = ctx.router
    ctl = ctx.ctl
    guarded = ctx.guarded
    store = ctx.router.store
    balancer = ctx.router.balancer
    known_ids = ctx.known_ids

    def find(replica_id: str) -> Replica:
        """The replica by id or agent URL; ``NotFound`` (404) names the ones the router knows."""
        for r in balancer.replicas:
            if replica_id in (r.replica_id, r.agent_url):
                return r
        raise NotFound(
            f"no replica {replica_id[:80]!r}: the router knows {sorted(known_ids())}",
            param="replica_id",
        )

    @api.get(
        "/v1/control/replicas",
        dependencies=ctl,
        response_model=ReplicaList,
        responses=errors(401, 403),
    )
    async def replicas() -> ReplicaList:
        return ReplicaList(replicas=[replica_status(r) for r in balancer.replicas])

    @api.get(
        "/v1/control/catch-up",
        dependencies=ctl,
        response_model=CatchUpList,
        responses=errors(401, 403),
    )
    async def catch_up() -> CatchUpList:
        """The relay trees catch-up is feeding now (docs/transfer.md), each with its progress."""
        if router.catch_up is None:
            return CatchUpList(trees=[])
        return CatchUpList(
            trees=[
                CatchUpTree(name=n, version=v, source=src, fed=fed, replicas=of)
                for (n, v, src), (fed, of) in sorted(router.catch_up.progress.items())
            ],
            relay_rates=router.catch_up.relay_rates,
            learned_from=router.catch_up.learned_from,
        )

    @api.put(
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
        url = peer_url(req.agent_url)
        r = find(replica_id)
        if url == r.agent_url:
            return replica_status(r)
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
        router.membership_changed()
        log.warning(
            "replica %s re-placed: %s -> %s; taken off %d name(s) until republished",
            r.replica_id, was, url, len(names),
        )  # fmt: skip
        return replica_status(r)

    @api.post(
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
        url = peer_url(req.agent_url)
        same = [r for r in balancer.replicas if r.agent_url == url]
        if same:
            return replica_status(same[0])
        r = balancer.add(url)
        router.membership_changed()
        if router.poller is not None:
            await router.poller.poll_once()
            router.poller.watch(r)
        log.warning("replica %s added at %s; catch-up feeds it", r.replica_id, url)
        return replica_status(r)

    @api.post(
        "/v1/control/replicas/{replica_id}/room",
        dependencies=ctl,
        response_model=RoomResult,
        responses=errors(*guarded, 404, 409, 413, 503),
    )
    async def make_room(
        replica_id: Annotated[str, FastAPIPath(max_length=MAX_REPLICA_ID)], req: RoomRequest
    ) -> RoomResult:
        """Free ``need`` adapter slots on the replica by evicting its least recently used
        versions of names other than ``keep``, each drained first (docs/placement.md). 409
        ``no_room`` when that many cannot be freed; 503 when the replica's agent does not
        answer."""
        return await router.placer.make_room(find(replica_id), req.need, frozenset(req.keep))

    @api.delete(
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
        drained (its requests in flight finish, on the router and on every data-plane copy, up
        to ``drain_s``), then forgotten. Its answer says how many requests were still in
        flight when it was forgotten (0: drained)."""
        r = find(replica_id)
        store.forget_replica(r.replica_id or r.agent_url, member=False)
        deadline = time.monotonic() + drain_s
        while r.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # The data-plane copies send there too: each reports its own count once it serves the
        # table without the replica.
        on_copies = await router.copies.wait_replica_drained(r.agent_url, deadline)
        status = replica_status(r)
        status.inflight += on_copies
        if router.poller is not None:
            await router.poller.unwatch(r)
        balancer.remove(r)
        router.membership_changed()
        router.prune_metrics()
        log.warning("replica %s removed (%d in flight)", status.replica_id, status.inflight)
        return status

    return api
