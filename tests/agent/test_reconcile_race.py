"""The reconciler must not call a replica unready because an unload is half-way through.

Seen under load: an engine drops a name from its listing as soon as an unload starts, while its
answer (and the agent's record removal) comes later. A reconciler pass in that window saw a desired
record "missing" and reported the agent not ready, and the router took the replica out of
rotation for every version: 1,860 of 5,139 routed requests failed with 503 during 20 publications.
"""

from __future__ import annotations

import asyncio

from lorafleet.agent.reconcile import Reconciler
from tests.agent.test_inprocess import Node, node  # noqa: F401 - fixture


def test_reconciler_stays_ready_while_an_unload_is_in_flight(node):  # noqa: F811
    async def scenario() -> None:
        rec = await node.publish({"adapter_config.json": b'{"r": 8}'}, "foo", 1)
        await node.svc.load("foo", 1, "versioned")
        reconciler = Reconciler(node.svc, interval=0.01)
        await reconciler.run_once()
        assert reconciler.ready

        gate = asyncio.Event()
        forgotten = asyncio.Event()
        engine_unload = node.engine.unload

        async def slow_unload(name: str) -> None:
            await engine_unload(name)  # the engine no longer lists it...
            forgotten.set()
            await gate.wait()  # ...but its answer has not come back yet

        node.engine.unload = slow_unload
        unloading = asyncio.create_task(node.svc.unload("foo", 1))
        await forgotten.wait()
        reconcile = asyncio.create_task(reconciler.run_once())
        for _ in range(20):  # let the pass run up to the name's lock
            await asyncio.sleep(0)
        assert reconciler.ready, reconciler.detail
        gate.set()
        await unloading
        await reconcile
        assert reconciler.ready, reconciler.detail
        assert rec.engine_name not in node.engine.held  # nothing was "reinstalled"

    asyncio.run(scenario())
