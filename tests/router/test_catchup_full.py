"""Catch-up onto a full engine (docs/quorum.md, docs/placement.md).

A replica that lagged while other names filled its engine's slots is caught up all the same: the
router evicts its least recently used version of another name (drained first, its verified files
kept) to make room, as a publication's replicas get room. Before, the catch-up was refused by the
agent (``quota_exceeded``) at every retry and the replica lagged for good.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from lorafleet.launch import Launcher
from lorafleet.publisher import Publisher, Timeouts
from lorafleet.testing import make_peft_adapter, wait_until

pytestmark = pytest.mark.timeout(300)

SLOTS = 2


def _holders(fleet, name: str, version: int) -> set[str]:
    entry = fleet.aliases().get(name, {"routable": []})
    return {r for v in entry["routable"] if v["version"] == version for r in v["replicas"]}


def test_a_lagging_replica_whose_engine_filled_up_is_caught_up(make_fleet, tiny_model, tmp_path):
    a, b, c = (make_peft_adapter(tiny_model, tmp_path / k, r=8, seed=70 + i) for i, k in
               enumerate("abc"))  # fmt: skip
    with Launcher(tmp_path / "logs") as launcher:
        fleet = make_fleet(launcher, 2, max_loras=SLOTS, replica_ids=True)
        late = fleet.replicas[1]
        with Publisher(
            fleet.agent_urls,
            router=fleet.router.url,
            token=fleet.token,
            timeouts=Timeouts(answer=2.0, straggler=10.0),
        ) as pub:
            pub.publish(str(a), name="lagger")
            pub.publish(str(b), name="filler")
            # Both engines are full: lagger v1 and filler v1.
            assert all(len(fleet.in_engine(i)) == SLOTS for i in range(2))
            late.agent.proc.signal(signal.SIGSTOP)
            try:
                res = pub.publish(str(c), name="lagger", min_replicas=1)
            finally:
                late.agent.proc.signal(signal.SIGCONT)
        assert res.version == 2 and set(res.lagging) == {late.replica_id}, res.lagging
        # The lagging replica needs a third slot for v2 while v1 drains: filler goes.
        wait_until(
            lambda: late.replica_id in _holders(fleet, "lagger", 2),
            timeout=60,
            message="the lagging replica is caught up on lagger v2",
        )
        assert "lagger" not in {n for n, e in fleet.aliases().items() if e["lagging"]}
        wait_until(
            lambda: set(fleet.in_engine(1)) == {"lagger@v2"},
            timeout=30,
            message="lagger v1 is released and filler evicted on the caught-up replica",
        )
        assert late.replica_id not in _holders(fleet, "filler", 1)
        # filler was evicted, not lost: its verified files stay, and a request loads it again.
        assert any(x["version"] == 1 for x in fleet.adapters(1, "filler"))
        r = httpx.post(
            fleet.router.url + "/v1/completions",
            json={"model": "filler", "prompt": "hi", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["lorafleet"]["version"] == 1, r.text
        for i in range(2):
            assert len(fleet.in_engine(i)) <= SLOTS
