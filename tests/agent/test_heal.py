"""A publication that failed while an engine was down must not wedge the name.

The unload of a rollback that the engine cannot answer is remembered (``retiring``) and finished
by the reconciler once the engine is back; a lease-holding publisher's next upload supersedes a
never-activated leftover instead of meeting ``409 adapter_conflict`` at every try.
"""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.agent.reconcile import Reconciler
from lorafleet.errors import AdapterConflict, EngineUnavailable
from lorafleet.protocol.agent import AdapterState
from tests.agent.test_inprocess import Node, manifest, node  # noqa: F401 - fixture

V2_OLD = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"old weights"}
V2_NEW = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"new weights"}


def _files(n: Node, name: str, version: int) -> bool:
    return n.store.adapter_dir(name, version).exists()


def test_unload_while_the_engine_is_down_is_finished_when_it_returns(node):  # noqa: F811
    async def scenario() -> None:
        await node.publish(V2_OLD, "foo", 2)
        await node.svc.load("foo", 2, "versioned")
        node.engine.down = True
        with pytest.raises(EngineUnavailable, match="stays until the engine answers"):
            await node.svc.unload("foo", 2)
        rec = node.db.get("foo", 2).record
        assert rec.state == AdapterState.RETIRING and "unload pending" in rec.error
        assert _files(node, "foo", 2)  # the engine may still hold them (promise 6)
        reconciler = Reconciler(node.svc)
        await reconciler.run_once()  # engine still down: nothing changes
        assert node.db.get("foo", 2).record.state == AdapterState.RETIRING
        node.engine.down = False
        node.engine.held.clear()  # it came back from a crash, empty
        await reconciler.run_once()
        assert node.db.get("foo", 2) is None and not _files(node, "foo", 2)
        assert node.blobs() == set() and reconciler.ready

    asyncio.run(scenario())


def test_next_publication_supersedes_a_never_activated_leftover(node):  # noqa: F811
    async def scenario() -> None:
        await node.publish(V2_OLD, "foo", 2)
        await node.svc.load("foo", 2, "versioned")  # a crashed publication's v2: never active
        new = manifest("foo", 2, V2_NEW)
        with pytest.raises(AdapterConflict):
            await node.svc.open_upload(new)  # no lease, no supersede: refused as before
        session = await node.svc.open_upload(new, supersede=True)
        assert "foo@v2" not in node.engine.held and node.db.get("foo", 2) is None
        for p in session.missing:
            await node.put(session.upload_id, p, V2_NEW[p])
        rec = await node.svc.commit(session.upload_id)
        assert rec.digest == new.digest
        await node.svc.load("foo", 2, "versioned")
        assert node.engine.held["foo@v2"] == rec.path

    asyncio.run(scenario())


def test_supersede_leaves_the_active_version_and_refuses_while_the_engine_is_down(node):  # noqa: F811
    async def scenario() -> None:
        await node.publish(V2_OLD, "foo", 1)
        await node.svc.load("foo", 1, "versioned")
        await node.svc.activate("foo", 1)
        await node.publish(V2_OLD, "foo", 2)
        await node.svc.load("foo", 2, "versioned")
        node.engine.down = True
        with pytest.raises(EngineUnavailable):
            await node.svc.open_upload(manifest("foo", 2, V2_NEW), supersede=True)
        assert node.db.get("foo", 2).record.state == AdapterState.RETIRING
        node.engine.down = False
        await node.svc.open_upload(manifest("foo", 2, V2_NEW), supersede=True)
        assert node.db.get("foo", 1).record.state == AdapterState.ACTIVE  # untouched
        assert node.engine.held == {"foo@v1": node.db.get("foo", 1).record.path}

    asyncio.run(scenario())
