"""In place on SGLang: the plain name is loaded from a link the agent points at the current
version, because SGLang re-reads a name's remembered path after an unload (seen on 0.5.23,
docs/engines/sglang.md); any such re-read must find the weights the agent last put there."""

from __future__ import annotations

import asyncio
import os

import pytest

from lorafleet.agent.store import LINK
from lorafleet.errors import EngineRejected
from lorafleet.protocol.agent import AdapterState, EngineCapabilities
from tests.agent.test_inprocess import Node, node  # noqa: F401 - fixture

V1 = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"v1 weights"}
V2 = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"v2 weights"}


@pytest.fixture
def sglang_node(node: Node) -> Node:  # noqa: F811
    node.svc.caps = EngineCapabilities(kind="sglang")
    return node


def _target(n: Node, name: str) -> str:
    return os.readlink(n.store.link_path(name))


def test_in_place_loads_through_the_link_and_repoints_it(sglang_node):
    n = sglang_node

    async def scenario() -> None:
        link = str(n.store.link_path("foo"))
        await n.publish(V1, "foo", 1)
        r1 = await n.svc.load("foo", 1, "in_place")
        assert n.engine.held == {"foo": link} and r1.path == link and _target(n, "foo") == "1"
        await n.publish(V2, "foo", 2)
        r2 = await n.svc.load("foo", 2, "in_place")
        assert n.engine.held == {"foo": link} and r2.path == link and _target(n, "foo") == "2"
        assert n.db.get("foo", 1).record.state == AdapterState.STAGED
        # a restarted agent keeps a link to a known version
        assert n.store.sweep({("foo", 1), ("foo", 2)}) == 0 and _target(n, "foo") == "2"
        # fail closed: the name leaves the engine and the link goes with it
        await n.svc.unload("foo", 2)
        assert "foo" not in n.engine.held and not os.path.lexists(n.store.link_path("foo"))

    asyncio.run(scenario())


def test_a_refused_in_place_load_points_the_link_back(sglang_node):
    n = sglang_node

    async def scenario() -> None:
        await n.publish(V1, "foo", 1)
        await n.svc.load("foo", 1, "in_place")
        await n.publish(V2, "foo", 2)
        n.engine.refuse = "incompatible with the current LoRA memory pool"
        with pytest.raises(EngineRejected):
            await n.svc.load("foo", 2, "in_place")
        assert _target(n, "foo") == "1"  # a re-read under the name finds v1's files

    asyncio.run(scenario())


def test_sweep_drops_a_link_to_an_unknown_version(tmp_path):
    from lorafleet.agent.store import Store

    store = Store(tmp_path)
    store.adapter_dir("foo", 3).mkdir(parents=True)
    store.point_link("foo", 3)
    assert store.sweep({("foo", 2)}) == 2  # the orphan version and its link
    assert not os.path.lexists(tmp_path / "adapters" / "foo" / LINK)
