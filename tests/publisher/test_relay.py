"""Relay publications on real agents and engines (on loopback, so asked for by name: the
default there is one copy per agent): one copy leaves the Publisher, agents forward
it, and faults between agents (a flipped byte, a killed or stalled forwarder) keep the
promises: every replica verifies its own copy, and the publication succeeds everywhere or
rolls back everywhere."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from lorafleet.bundle import AdapterBundle
from lorafleet.errors import PublishError
from lorafleet.protocol.relay import RelayRates
from lorafleet.publisher import Publisher
from lorafleet.testing import ALL_LINEAR, make_peft_adapter, make_peft_model, merged_greedy_ids
from tests.netfaults import FaultyLink
from tests.publisher.test_publish import (
    PROMPT,
    _assert_v1_still_serving_and_v2_nowhere,
    routed_greedy,
)


@pytest.fixture(scope="module")
def small(tiny_model, tmp_path_factory):
    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("relay") / "small", r=8, seed=31)


@pytest.fixture(scope="module")
def large(tiny_model, tmp_path_factory):
    """An adapter of ~1.5 MiB: long enough on a 1 MB/s link to be cut mid-stream."""
    model = make_peft_model(tiny_model, r=64, seed=32, target_modules=ALL_LINEAR)
    out = tmp_path_factory.mktemp("relay") / "large"
    model.save_pretrained(out)
    return out


def _id(server) -> str:
    return server.url.removeprefix("http://")


def _serves(fleet, tiny_model, adapter, version):
    expected = merged_greedy_ids(tiny_model, adapter, PROMPT, 8)
    for _ in range(3):
        ids, body = routed_greedy(fleet.router, "policy")
        assert body["lorafleet"]["version"] == version and ids == expected


def test_a_tree_of_fanout_two_sends_one_copy(launcher, make_fleet, small, tiny_model):
    fleet = make_fleet(launcher, 3)
    size = AdapterBundle.from_dir(small, name="x").total_size
    with Publisher(
        fleet.agent_urls, router=fleet.router.url, token=fleet.token, relay_fanout=2
    ) as pub:
        res = pub.publish(str(small), name="policy", transfer="relay")
    assert res.transfer == "relay" and res.bytes_sent == size
    root, *rest = (res.replicas[_id(a)] for a in fleet.agents)
    assert (root.bytes_sent, root.bytes_relayed) == (size, 0)
    assert [(t.bytes_sent, t.bytes_relayed) for t in rest] == [(0, size)] * 2
    # Each file's tree was timed (every hop reports its own copy's time), and the Publisher,
    # given no rates, planned the next one with what it measured.
    files = AdapterBundle.from_dir(small, name="x").manifest.files
    assert sorted(m.size for m in res.relay_measured) == sorted(f.size for f in files)
    for m in res.relay_measured:
        assert (m.nodes, m.fanout, m.depth) == (3, 2, 1) and 0 < m.leaf_s <= m.seconds, m
    assert pub._async.relay_rates.hop_s != RelayRates().hop_s
    _serves(fleet, tiny_model, small, 1)
    assert fleet.staging_bytes() == [0, 0, 0]


def test_a_replica_that_holds_the_blobs_is_skipped(launcher, make_fleet, small, tiny_model):
    fleet = make_fleet(launcher, 3)
    with Publisher(fleet.agent_urls[1:2], router=fleet.router.url, token=fleet.token) as pub:
        pub.publish(str(small), name="other")  # replica 1 now holds every blob
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        res = pub.publish(str(small), name="policy", transfer="relay")
    size = AdapterBundle.from_dir(small, name="x").total_size
    held = res.replicas[_id(fleet.agents[1])]
    assert (held.files_deduplicated, held.bytes_sent, held.bytes_relayed) == (2, 0, 0)
    assert res.bytes_sent == size  # replica 0 from here, replica 2 from replica 0
    assert res.replicas[_id(fleet.agents[2])].bytes_relayed == size
    _serves(fleet, tiny_model, small, 1)


def test_a_byte_flipped_between_two_agents_rolls_back_everywhere(
    launcher, make_fleet, small, large, tiny_model
):
    fleet = make_fleet(launcher, 3)
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        pub.publish(str(small), name="policy")
    # Replica 1 is reached through a link that flips one bit of the first upload body it
    # carries: replica 0 forwards to it through that link.
    with FaultyLink(fleet.agents[1].port, flip_at=100_000) as link:
        urls = [fleet.agent_urls[0], link.url, fleet.agent_urls[2]]
        with (
            Publisher(urls, router=fleet.router.url, token=fleet.token) as pub,
            pytest.raises(PublishError) as err,
        ):
            pub.publish(str(large), name="policy", transfer="relay")
        assert link.flipped
    failures = err.value.failures
    assert _id(fleet.agents[1]) in failures and "digest" in failures[_id(fleet.agents[1])]
    assert _id(fleet.agents[0]) not in failures
    assert "v1 keeps serving" in str(err.value)
    _assert_v1_still_serving_and_v2_nowhere(fleet, tiny_model, small)


def _publish_large_cutting_replica_1(fleet, small, large, cut, **publisher_kwargs):
    """Publish v1 (small), then v2 (large) down a chain (0 -> 1 -> 2) with replica 1 behind a
    1 MB/s link; ``cut(proc)`` runs when 256 KiB of v2 passed that link (replica 1 is then
    relaying to replica 2)."""
    publisher_kwargs.setdefault("relay_fanout", 1)
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        pub.publish(str(small), name="policy")
    fired = threading.Event()

    def on_bytes() -> None:
        fired.set()
        cut(fleet.agents[1].proc)

    with FaultyLink(fleet.agents[1].port, rate=1e6, after_body=(256 << 10, on_bytes)) as link:
        urls = [fleet.agent_urls[0], link.url, fleet.agent_urls[2]]
        with Publisher(
            urls, router=fleet.router.url, token=fleet.token, relay_stall_s=2, **publisher_kwargs
        ) as pub:
            try:
                return pub.publish(str(large), name="policy", transfer="relay")
            finally:
                assert fired.is_set()


def test_a_relaying_agent_killed_mid_stream_and_restarted(
    launcher, make_fleet, small, large, tiny_model
):
    """Replica 2's copy stops at a durable prefix and is resumed from replica 0's verified
    copy; replica 1 comes back (as a supervisor would restart it) and gets a fresh session, fed
    by a replica too: the trainer's link carries exactly one copy."""
    fleet = make_fleet(launcher, 3)

    def kill_and_restart(proc) -> None:
        proc.kill()
        threading.Thread(target=fleet.restart_agent, args=(1,), daemon=True).start()

    res = _publish_large_cutting_replica_1(fleet, small, large, kill_and_restart)
    size = AdapterBundle.from_dir(large, name="x").total_size
    assert res.version == 2
    assert res.replicas[_id(fleet.agents[0])].bytes_sent == size
    # Nothing more left the trainer: replicas 1 and 2 got the rest from a peer.
    assert res.bytes_sent == size
    for i in (1, 2):
        assert res.replicas[_id(fleet.agents[i])].bytes_sent == 0
        assert res.replicas[_id(fleet.agents[i])].bytes_relayed > 0
    _serves(fleet, tiny_model, large, 2)
    assert fleet.staging_bytes() == [0, 0, 0]


def test_a_relaying_agent_killed_for_good_rolls_back_everywhere(
    launcher, make_fleet, small, large, tiny_model
):
    fleet = make_fleet(launcher, 3)
    with pytest.raises(PublishError) as err:
        _publish_large_cutting_replica_1(fleet, small, large, lambda proc: proc.kill())
    assert list(err.value.failures) == [_id(fleet.agents[1])]
    for i in (0, 2):
        assert {a["version"] for a in fleet.adapters(i)} == {1}
    assert [fleet.staging_bytes()[i] for i in (0, 2)] == [0, 0]
    fleet.restart_agent(1)
    _assert_v1_still_serving_and_v2_nowhere(fleet, tiny_model, small)


def test_a_stalled_relaying_agent_is_dropped_and_resumed(
    launcher, make_fleet, small, large, tiny_model
):
    """SIGSTOP replica 1 past the stall limit: replica 0 drops it and finishes, replica 2's
    copy is cut off and resumed from replica 0; once replica 1 runs again, it is resumed too,
    and nothing but the first copy left the trainer."""
    fleet = make_fleet(launcher, 3)

    def stall(proc) -> None:
        os.kill(proc.pid, signal.SIGSTOP)

        def resume() -> None:
            time.sleep(4.0)
            os.kill(proc.pid, signal.SIGCONT)

        threading.Thread(target=resume, daemon=True).start()

    res = _publish_large_cutting_replica_1(fleet, small, large, stall)
    assert res.version == 2
    assert res.bytes_sent == AdapterBundle.from_dir(large, name="x").total_size
    assert all(t.state.value == "active" for t in res.replicas.values())
    _serves(fleet, tiny_model, large, 2)
    assert fleet.staging_bytes() == [0, 0, 0]
