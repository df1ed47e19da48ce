"""Which transfer a publication uses when none is named: the relay across hosts, one copy per
agent on one host (the measured choice; see ``AsyncPublisher.default_transfer``)."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.publisher import AsyncPublisher


@pytest.mark.parametrize(
    "agents, expected",
    [
        (["http://10.0.0.1:8100"], "remote_upload"),
        (["http://127.0.0.1:8100", "http://localhost:8101", "http://[::1]:8102"], "remote_upload"),
        (["http://node1:8100", "http://node1:8101"], "remote_upload"),
        (["http://node1:8100", "http://node2:8100"], "relay"),
        (["http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://10.0.0.2:8101"], "relay"),
    ],
)
def test_relay_when_the_agents_span_hosts(agents, expected):
    async def choose() -> str:
        async with AsyncPublisher(agents) as pub:
            return pub.default_transfer()

    assert asyncio.run(choose()) == expected


def test_an_unknown_transfer_is_refused_before_anything_moves():
    async def publish() -> None:
        async with AsyncPublisher(["http://127.0.0.1:9"]) as pub:
            await pub.apublish(b"not even a bundle", name="policy", transfer="carrier-pigeon")

    with pytest.raises(ValueError, match="unknown transfer"):
        asyncio.run(publish())
