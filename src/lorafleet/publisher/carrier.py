"""Carriers: how a publication's files reach every replica, as an extension point.

A carrier is called once per publication, after the Publisher has taken the lease and chosen the
version and before anything is loaded. It must leave on every replica an open upload session
(``ReplicaTxn.open``, then ``upload_id``) holding every file of ``plan.bundle``, each verified by
that replica's agent (declared size and sha-256, as for any upload), and return the replicas it
could not serve (replica id -> exception). The Publisher then commits, loads, verifies and cuts
over exactly as for its own transfers, and on any failure rolls back everywhere (discarding
every session the carrier opened).

Built in: ``relay`` (``_relay.py``). ``lorafleet.ray`` adds ``object_store``. Pass more to
``Publisher(carriers={"name": carrier})`` and publish with ``transfer="name"``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from lorafleet.publisher._plan import Plan
from lorafleet.publisher._relay import Relay
from lorafleet.publisher._replica import ReplicaTxn

__all__ = ["Carrier", "Plan", "ReplicaTxn", "relay"]

Carrier = Callable[[Plan, Sequence[ReplicaTxn]], Awaitable[Mapping[str, BaseException]]]


async def relay(plan: Plan, replicas: Sequence[ReplicaTxn]) -> Mapping[str, BaseException]:
    """The relay: each file leaves the Publisher once; agents forward it (``_relay.py``)."""
    return await Relay(plan, replicas).run()
