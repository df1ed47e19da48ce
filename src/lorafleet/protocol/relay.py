"""Relay trees: their shape, how one is chosen, and the forward plans that lay one out.

One file moves down a tree of upload sessions: the source (the trainer in a publication, a peer
agent in a catch-up) sends it to the root, and every session forwards it to its children while
it streams in (``agent/relay.py``). Nodes are laid out breadth-first (node 0 is the root).

A tree of fan-out ``f`` over ``n`` nodes lands its last copy after

    fixed + size / min(recv, link / f) + depth(n, f) * hop

seconds: every hop receives and verifies at ``recv`` bytes/s at most, a node forwarding to ``f``
children shares its link (``link`` bytes/s) between them, and each level adds ``hop`` (a hop's
first-byte delay and its verdict). ``plan_fanout`` picks the ``f`` that minimizes it: a chain
where links are the limit and replicas few, wider trees as the fleet grows or the adapter
shrinks. The Publisher (``publisher/_relay.py``) and catch-up (``lorafleet.install.feed_tree``)
both plan with it, and ``bench/quorum_sim.py`` models with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.protocol.agent import MAX_FANOUT, ForwardPlan, ForwardTarget

__all__ = ["RelayRates", "depth", "forward_plans", "height", "plan_fanout", "relay_time", "tree"]


@dataclass(frozen=True)
class RelayRates:
    """What a relay tree's time depends on (bytes/s and seconds).

    The defaults are this project's measurements (bench/RESULTS.md: an agent verifies and writes
    ~750 MiB/s on a busy 2-core node; a hop adds ~57 ms) and a 10 Gbit/s link per host; give the
    fleet's own where they differ (``Publisher(relay_rates=...)``)."""

    link_Bps: float = 1.25e9
    recv_Bps: float = 750 * 2**20
    hop_s: float = 0.057
    fixed_s: float = 0.0


def tree(n: int, fanout: int) -> list[list[int]]:
    """Children of each of ``n`` nodes laid out breadth-first (node 0 is the root)."""
    return [list(range(i * fanout + 1, min(n, i * fanout + fanout + 1))) for i in range(n)]


def height(children: list[list[int]], i: int) -> int:
    """Levels below node ``i`` in ``children`` (0 for a leaf)."""
    return 1 + max((height(children, c) for c in children[i]), default=0) if children[i] else 0


def depth(n: int, fanout: int) -> int:
    """Hops from the root to the deepest of ``n`` nodes laid out breadth-first."""
    if n <= 1:
        return 0
    if fanout == 1:
        return n - 1
    d, level, covered = 0, 1, 1
    while covered < n:
        level *= fanout
        covered += level
        d += 1
    return d


def relay_time(n: int, size: float, fanout: int, rates: RelayRates) -> float:
    """The model's seconds for a tree of ``fanout`` to land ``size`` bytes on ``n`` nodes (one
    copy from the source to the root, then down the tree)."""
    if n <= 0:
        return 0.0
    f = min(fanout, n - 1) or 1
    rate = min(rates.recv_Bps, rates.link_Bps / f)
    return rates.fixed_s + size / rate + (depth(n, fanout) + 1) * rates.hop_s


def plan_fanout(n: int, size: float, rates: RelayRates = RelayRates()) -> int:
    """The fan-out (1 to ``MAX_FANOUT``) whose tree lands ``size`` bytes on ``n`` nodes
    soonest by ``relay_time``; the narrower one on a tie (fewer copies per link)."""
    return min(range(1, MAX_FANOUT + 1), key=lambda f: (round(relay_time(n, size, f, rates), 9), f))


def forward_plans(
    targets: Sequence[ForwardTarget],
    path: str,
    fanout: int,
    credential: str,
    stall_s: float,
) -> dict[int, ForwardPlan]:
    """For one file moving down a tree of fan-out ``fanout`` over ``targets`` (node ``i`` is
    ``targets[i]``): each internal node's forward plan, by index. A child's verdict is awaited
    for as long as its subtree may take (its height in stall periods, plus a margin)."""
    children = tree(len(targets), fanout)
    return {
        i: ForwardPlan(
            credential=credential,
            stall_s=stall_s,
            files={
                path: [
                    targets[c].model_copy(
                        update={"answer_timeout_s": stall_s * (height(children, c) + 1) + 10.0}
                    )
                    for c in kids
                ]
            },
        )
        for i, kids in enumerate(children)
        if kids
    }
