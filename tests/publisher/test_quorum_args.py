"""``min_replicas``: a count or a fraction, the same in the API, the CLI and the front."""

from __future__ import annotations

import pytest

from lorafleet.publisher.cli import parse_min_replicas
from lorafleet.publisher.publisher import AsyncPublisher


@pytest.mark.parametrize(
    ("asked", "n", "needed"),
    [(None, 4, None), (3, 4, 3), (4, 4, None), (0.75, 4, 3), (0.5, 3, 2), (1.0, 4, None),
     (0.01, 400, 4)],
)  # fmt: skip
def test_a_count_or_a_fraction(asked, n, needed):
    assert AsyncPublisher._quorum_of(asked, n) == needed


@pytest.mark.parametrize("asked", [0, 5, -1, 0.0, 1.5, True, "3"])
def test_out_of_range_is_refused(asked):
    with pytest.raises(ValueError):
        AsyncPublisher._quorum_of(asked, 4)


def test_the_cli_and_front_parse_the_same():
    assert parse_min_replicas("3") == 3 and parse_min_replicas("0.75") == 0.75
    assert parse_min_replicas(None) is None
    for bad in ("three", "0", "1.5"):
        if bad == "0":
            assert parse_min_replicas(bad) == 0  # a count: refused by the Publisher
            continue
        with pytest.raises(ValueError):
            parse_min_replicas(bad)


def test_a_quorum_needs_a_router():
    pub = AsyncPublisher.__new__(AsyncPublisher)
    pub._agents, pub.router = [object(), object()], None  # type: ignore[list-item]
    with pytest.raises(ValueError, match="router"):
        pub._quorum(1, "in_place")
