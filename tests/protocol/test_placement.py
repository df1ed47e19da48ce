"""Rendezvous hashing, the placement rule the Publisher and the router share."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lorafleet.protocol.placement import rendezvous

ids = st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=12, unique=True)


@given(ids, st.lists(st.text(max_size=16), min_size=1, max_size=50))
def test_a_replica_that_leaves_moves_only_the_names_it_ranked_first(replicas, names):
    gone = replicas[0]
    rest = replicas[1:]
    for name in names:
        before = rendezvous(name, replicas)
        after = rendezvous(name, rest)
        assert sorted(before) == sorted(replicas)
        # Everyone else keeps its relative order; only the departed replica's share moves.
        assert [r for r in before if r != gone] == after


@given(ids, st.text(max_size=16))
def test_the_order_does_not_depend_on_how_the_replicas_are_listed(replicas, name):
    assert rendezvous(name, replicas) == rendezvous(name, list(reversed(replicas)))
