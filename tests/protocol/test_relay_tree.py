"""The relay tree's shape and the planner that picks its fan-out (``protocol/relay.py``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lorafleet.protocol.agent import MAX_FANOUT, ForwardTarget
from lorafleet.protocol.relay import (
    RelayRates,
    depth,
    forward_plans,
    plan_fanout,
    relay_time,
    tree,
)

MiB = 2**20


@given(n=st.integers(1, 5000), f=st.integers(1, MAX_FANOUT))
def test_a_tree_covers_every_node_once_and_its_depth_is_the_deepest_node(n, f):
    children = tree(n, f)
    seen = [c for kids in children for c in kids]
    assert sorted(seen) == list(range(1, n))
    assert all(len(kids) <= f for kids in children)
    level = {0: 0}
    for i, kids in enumerate(children):
        for c in kids:
            level[c] = level[i] + 1
    assert max(level.values()) == depth(n, f)


def test_a_chain_where_the_link_is_the_limit_and_replicas_are_few():
    # 100 Mbit/s links, 8 MiB, 8 replicas: each extra copy per link costs more than the hops.
    rates = RelayRates(link_Bps=12.5e6, recv_Bps=750 * MiB, hop_s=0.057)
    assert plan_fanout(8, 8 * MiB, rates) == 1


def test_a_wider_tree_as_the_fleet_grows_or_the_adapter_shrinks():
    rates = RelayRates(link_Bps=50e6, recv_Bps=750 * MiB, hop_s=0.057)
    assert plan_fanout(4096, 64 * MiB, rates) > 1
    assert plan_fanout(4096, 64 * MiB, rates) <= plan_fanout(4096, 64 * 1024, rates)
    # A small adapter is all hops: as shallow as the widest tree (the narrowest such).
    f = plan_fanout(64, 31 * 1024, rates)
    assert depth(64, f) == depth(64, MAX_FANOUT) and depth(64, f - 1) > depth(64, f)


def test_where_receiving_is_the_limit_fanning_out_is_free():
    # A 10 Gbit/s link forwarding to 2 children still outruns a 750 MiB/s receiver.
    rates = RelayRates(link_Bps=1.25e9, recv_Bps=500 * MiB, hop_s=0.057)
    f = plan_fanout(64, 64 * MiB, rates)
    assert f >= 2
    assert relay_time(64, 64 * MiB, f, rates) < relay_time(64, 64 * MiB, 1, rates)


@given(n=st.integers(1, 5000), size=st.integers(1, 2**31), hop=st.floats(0.001, 1.0))
def test_the_planned_fanout_is_never_slower_than_a_chain_or_a_star(n, size, hop):
    rates = RelayRates(link_Bps=1.25e8, recv_Bps=5e8, hop_s=hop)
    f = plan_fanout(n, size, rates)
    best = relay_time(n, size, f, rates)
    assert best <= relay_time(n, size, 1, rates) + 1e-9
    assert best <= relay_time(n, size, MAX_FANOUT, rates) + 1e-9


def test_forward_plans_name_each_nodes_children_and_wait_longer_near_the_root():
    targets = [
        ForwardTarget(url=f"http://127.0.0.1:{9000 + i}", upload_id=f"{i:032x}", answer_timeout_s=1)
        for i in range(7)
    ]
    plans = forward_plans(targets, "adapter_model.safetensors", 2, "c" * 32, stall_s=10.0)
    assert sorted(plans) == [0, 1, 2]
    kids = {i: [t.url for t in p.files["adapter_model.safetensors"]] for i, p in plans.items()}
    assert kids[0] == [targets[1].url, targets[2].url]
    assert kids[1] == [targets[3].url, targets[4].url]
    root_wait = plans[0].files["adapter_model.safetensors"][0].answer_timeout_s
    leaf_wait = plans[1].files["adapter_model.safetensors"][0].answer_timeout_s
    assert root_wait > leaf_wait
