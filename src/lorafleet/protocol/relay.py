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

The rates are measured as the fleet runs: each hop reports how long its copy took from its first
byte to its verdict (``RelayHop.seconds``), so for every file that moved down a tree the
Publisher has the whole tree's time and the deepest hop's (``measure``), hence the per-hop time
and the rate a hop received at; ``RelayRates.learned`` folds that into the rates the next
publication plans with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import median

from lorafleet.protocol.agent import MAX_FANOUT, ForwardPlan, ForwardTarget

__all__ = [
    "RelayMeasure",
    "RelayRates",
    "depth",
    "forward_plans",
    "height",
    "measure",
    "plan_fanout",
    "relay_time",
    "tree",
]

MIN_RATE_BYTES = 4 << 20
"""A file smaller than this says nothing about rates (its time is the hops'): only its per-hop
time is learnt."""
LEARN_WEIGHT = 0.5
"""How much one measurement moves the rates (an exponentially weighted mean)."""


@dataclass(frozen=True)
class RelayMeasure:
    """What one file's tree took, as the Publisher saw it (``measure``)."""

    size: int
    nodes: int
    fanout: int
    depth: int
    seconds: float
    """From the first byte sent to the root until the whole tree's verdict."""
    leaf_s: float
    """The deepest hop's own copy: from its first byte to its verdict (median of that level)."""

    @property
    def hop_s(self) -> float:
        """The time each level adds: (the tree's time - the deepest hop's) / its depth."""
        return max(0.0, self.seconds - self.leaf_s) / self.depth if self.depth else 0.0

    @property
    def rate_Bps(self) -> float:
        """The rate a hop received at: the deepest copy's bytes over its time less one hop's."""
        return self.size / max(self.leaf_s - self.hop_s, 1e-6)


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

    def learned(self, m: RelayMeasure, weight: float = LEARN_WEIGHT) -> RelayRates:
        """These rates moved towards what ``m`` measured. A tree of fan-out f measures
        min(recv, link / f) and cannot say which bound it; it is read as the link's (link =
        rate * f), the cautious reading: wider trees are then planned only where the hops they
        save cost more than the rate they share."""
        if m.depth == 0:
            return self

        def toward(old: float, new: float) -> float:
            return (1 - weight) * old + weight * new

        out = replace(self, hop_s=toward(self.hop_s, m.hop_s))
        if m.size < MIN_RATE_BYTES:
            return out
        rate, f = m.rate_Bps, max(1, min(m.fanout, m.nodes - 1))
        recv = toward(self.recv_Bps, rate) if f == 1 else max(self.recv_Bps, rate)
        return replace(out, link_Bps=toward(self.link_Bps, rate * f), recv_Bps=recv)


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


def measure(
    size: int, fanout: int, seconds: float, hop_seconds: Sequence[float | None]
) -> RelayMeasure | None:
    """The measurement of one file's tree of ``fanout`` over ``len(hop_seconds) + 1`` nodes:
    ``seconds`` the whole tree's (root included), ``hop_seconds[i - 1]`` node i's own copy
    (``RelayHop.seconds``). None for a single node or a hop that reported no time."""
    n = len(hop_seconds) + 1
    if n < 2 or any(s is None for s in hop_seconds):
        return None
    children, level = tree(n, fanout), [0] * n
    for i, kids in enumerate(children):
        for c in kids:
            level[c] = level[i] + 1
    d = max(level)
    leaf = median(s for i, s in enumerate(hop_seconds, start=1) if level[i] == d)  # type: ignore[type-var]
    return RelayMeasure(
        size=size, nodes=n, fanout=fanout, depth=d, seconds=seconds, leaf_s=float(leaf)
    )


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
