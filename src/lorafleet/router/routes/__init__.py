"""The router's control-plane routes, one module per group (each a FastAPI ``APIRouter``).

``reads``: health and metrics; ``aliases``: the table, flips, version numbers,
drains; ``leases``: publication leases; ``replicas``: membership and moves; ``copies``: the
data-plane copies' syncs, pins and status; ``registrations``: adapters registered by
reference. Each group's
``routes(ctx)`` takes one ``RouteContext``: the router and the dependencies its routes use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lorafleet.dataplane.balancer import Balancer, Replica
from lorafleet.dataplane.health import HealthPoller
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.errors import UnknownReplica
from lorafleet.protocol.router import ReplicaStatus
from lorafleet.router.catchup import CatchUp
from lorafleet.router.config import RouterConfig
from lorafleet.router.copies import Copies
from lorafleet.router.placement import Placer
from lorafleet.router.sources import Sources
from lorafleet.router.table import AliasStore

__all__ = ["RouteContext", "RouterState", "replica_status"]


class RouterState(Protocol):
    """What the route groups read and change (``RouterApp``)."""

    store: AliasStore
    balancer: Balancer
    metrics: RouterMetrics
    poller: HealthPoller | None
    copies: Copies
    placer: Placer
    sources: Sources
    catch_up: CatchUp | None
    config: RouterConfig

    def prune_metrics(self) -> None: ...
    def membership_changed(self) -> None: ...
    def export_gauges(self) -> None: ...


@dataclass(frozen=True)
class RouteContext:
    """What the route groups share: ``ctl`` guards control routes (the control token),
    ``inference`` the data plane's reads (the API key); ``guarded`` and ``keyed`` are the
    statuses those guards add to a route's documentation."""

    router: RouterState
    ctl: list[Any]
    inference: list[Any]
    guarded: tuple[int, ...]
    keyed: tuple[int, ...]

    def known_ids(self) -> set[str]:
        return {r.replica_id for r in self.router.balancer.replicas if r.replica_id}

    async def check_replicas(self, ids: list[str]) -> None:
        """Refuse (409 ``unknown_replica``) an alias naming a replica no agent reports."""
        unknown = sorted(set(ids) - self.known_ids())
        if unknown and self.router.poller is not None:
            # An agent that was unreachable at the last poll may answer now.
            await self.router.poller.poll_once()
            unknown = sorted(set(ids) - self.known_ids())
        if unknown:
            shown = ", ".join(repr(u)[:80] for u in unknown[:5])
            raise UnknownReplica(
                f"unknown replica id(s) {shown}: the router knows {sorted(self.known_ids())}",
                param="replicas",
            )


def replica_status(r: Replica) -> ReplicaStatus:
    """How ``lorafleet status`` and the membership routes show one replica."""
    return ReplicaStatus(
        replica_id=r.replica_id or r.agent_url,
        agent_url=r.agent_url,
        engine_url=r.engine_url,
        healthy=r.routable,
        inflight=r.inflight,
        detail=r.detail,
    )
