"""An abandoned upload session never blocks its name: a publisher holding the lease, or the
router's catch-up, opens with ``supersede`` and the old session (other bytes) gives way."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.errors import PublishInProgress
from tests.agent.test_inprocess import manifest, node  # noqa: F401 - node: the fixture


def test_an_abandoned_session_gives_way_only_to_supersede(node):  # noqa: F811
    async def go() -> None:
        half = {"adapter_model.safetensors": b"x" * 64, "adapter_config.json": b'{"r": 8}'}
        old = node.uploads.open(manifest("foo", 2, half), node.svc.check_version)
        await node.put(old.upload_id, "adapter_config.json", half["adapter_config.json"])
        other = {"adapter_model.safetensors": b"y" * 64, "adapter_config.json": b'{"r": 8}'}
        with pytest.raises(PublishInProgress):
            await node.svc.open_upload(manifest("foo", 2, other))
        assert old.upload_id in node.uploads.sessions
        new = await node.svc.open_upload(manifest("foo", 2, other), supersede=True)
        assert old.upload_id not in node.uploads.sessions
        assert list(node.uploads.sessions) == [new.upload_id]
        assert not (node.store.root / "staging" / old.upload_id).exists()
        for p in new.missing:
            await node.put(new.upload_id, p, other[p])
        rec = await node.svc.commit(new.upload_id)
        assert rec.digest == manifest("foo", 2, other).digest

    asyncio.run(go())
