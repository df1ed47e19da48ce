"""The relay tree's shape and the planner that picks its fan-out (``protocol/relay.py``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lorafleet.protocol.agent import MAX_FANOUT, ForwardTarget
from lorafleet.protocol.relay import (
    RelayRates,
    depth,
    forward_plans,
    measure,
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


@given(
    n=st.integers(2, 300),
    f=st.integers(1, MAX_FANOUT),
    size=st.integers(MiB, 2**31),
    rate=st.floats(1e7, 5e9),
    hop=st.floats(0.001, 0.5),
)
def test_a_measured_tree_gives_back_its_per_hop_time_and_receive_rate(n, f, size, rate, hop):
    # Times laid out as the model says: each node's copy takes size / rate plus its own hop;
    # each level above adds one hop to what its sender sees.
    children = tree(n, f)
    level = [0] * n
    for i, kids in enumerate(children):
        for c in kids:
            level[c] = level[i] + 1
    d = max(level)
    own = size / rate + hop
    seconds = own + d * hop
    hops = [own + (d - level[i]) * hop for i in range(1, n)]
    m = measure(size, f, seconds, hops)
    assert m is not None and m.depth == d == depth(n, f)
    assert abs(m.hop_s - hop) < 1e-6 * (1 + hop)
    assert abs(m.rate_Bps - rate) / rate < 1e-6


def test_no_measure_without_every_hops_time_or_for_a_lone_node():
    assert measure(MiB, 1, 1.0, []) is None
    assert measure(MiB, 1, 1.0, [0.5, None]) is None


def test_learnt_rates_move_towards_the_measure_and_plan_from_it():
    start = RelayRates()  # the defaults: a 10 Gbit/s link, 750 MiB/s, 57 ms a hop
    # A chain on 400 Mbit/s links with 15 ms hops (the netbed's figures): two measures, four.
    hop, rate, size, n = 0.015, 50e6, 64 * MiB, 8
    own = size / rate + hop
    m = measure(size, 1, own + (n - 1) * hop, [own + (n - 1 - i) * hop for i in range(1, n)])
    assert m is not None
    rates = start.learned(m).learned(m)
    assert abs(rates.hop_s - (0.75 * hop + 0.25 * start.hop_s)) < 1e-9
    assert rates.link_Bps < start.link_Bps / 3 and rates.recv_Bps < start.recv_Bps / 3
    rates = rates.learned(m).learned(m)
    assert abs(rates.recv_Bps - rate) < (start.recv_Bps - rate) / 15
    # With what was learnt the planner keeps a chain at 8 (a fan-out shares the 400 Mbit/s link)
    # where the defaults would have fanned out.
    assert plan_fanout(n, size, rates) == 1 < plan_fanout(n, size, start)
    # A small file teaches the per-hop time only.
    small = measure(4096, 1, 0.2, [0.2 - i * 0.05 for i in range(1, 4)])
    assert small is not None
    kept = rates.learned(small)
    assert (kept.link_Bps, kept.recv_Bps) == (rates.link_Bps, rates.recv_Bps)
    assert abs(kept.hop_s - (0.5 * rates.hop_s + 0.5 * small.hop_s)) < 1e-12
