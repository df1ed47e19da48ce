"""The alias table's quorum state: reserved version numbers, holders with digests, lagging replicas.

Pure ``AliasStore`` (no processes): what is persisted survives a restart, a number is never
handed out twice unless given back, and a claim for other bytes is never listed.
"""

from __future__ import annotations

import pytest

from lorafleet.errors import PublishInProgress, VersionConflict
from lorafleet.protocol.canary import CanaryVerdict
from lorafleet.protocol.router import LagState
from lorafleet.router.table import AliasStore

D1, D2 = "1" * 64, "2" * 64


def test_reserved_numbers_strictly_increase_across_failures_and_restarts(tmp_path):
    store = AliasStore(tmp_path)
    store.acquire_lease("p", "me", 60)
    assert store.reserve("p", "me") == 1
    # burnt (never given back): the next attempt gets 2, also after a restart
    store = AliasStore(tmp_path)
    assert store.reserve("p", "me") == 2
    # given back (its attempt reached no engine): the next one takes it again
    assert store.release_version("p", "me", 2)
    assert store.reserve("p", "me") == 2
    store.set_alias("p", 2, "p@v2", ["r0"], lease_holder="me", digest=D1)
    store = AliasStore(tmp_path)
    # a number flipped to is never given back, and one asked for must be above every one
    assert not store.release_version("p", "me", 2)
    with pytest.raises(VersionConflict):
        store.reserve("p", "me", 2)
    assert store.reserve("p", "me", 7) == 7
    assert store.reserve("p", "me") == 8
    # only the newest number can be given back
    assert not store.release_version("p", "me", 7)
    assert store.release_version("p", "me", 8)
    assert store.reserve("p", "me") == 8


def test_reserve_and_release_need_the_lease(tmp_path):
    store = AliasStore(tmp_path)
    store.acquire_lease("p", "me", 60)
    with pytest.raises(PublishInProgress):
        store.reserve("p", "other")
    v = store.reserve("p", "me")
    with pytest.raises(PublishInProgress):
        store.release_version("p", "other", v)


def test_a_flip_made_without_a_reservation_still_raises_the_floor(tmp_path):
    store = AliasStore(tmp_path)
    store.set_alias("p", 5, "p@v5", ["r0"])
    assert store.reserve("p", "me") == 6


def test_holders_carry_the_digest_and_lagging_replicas_are_kept(tmp_path):
    store = AliasStore(tmp_path)
    lag = {"r2": LagState(since_version=1, reason="silent", retry_at=0.0)}
    store.set_alias("p", 1, "p@v1", ["r0", "r1"], digest=D1, lagging=lag)
    e = store.aliases["p"]
    assert e.window()[0].digest == D1 and set(e.lagging) == {"r2"}
    # v2 on r0 only: r1 now lags too, r2 still since v1 and counted again
    store.set_alias("p", 2, "p@v2", ["r0"], digest=D2, lagging={"r1": lag["r2"], "r2": lag["r2"]})
    e = store.aliases["p"]
    assert e.lagging["r2"].since_version == 1 and e.lagging["r2"].failures == 2
    assert e.lagging["r1"].failures == 1
    # a claim for other bytes is never listed; the right one is, and ends the lag
    assert not store.add_holder("p", 2, D1, "r1")
    assert store.add_holder("p", 2, D2, "r1")
    store = AliasStore(tmp_path)
    e = store.aliases["p"]
    assert e.replicas == ["r0", "r1"] and e.window()[0].replicas == ["r0", "r1"]
    assert set(e.lagging) == {"r2"}
    # a listed replica that lost the version is taken off it and lags
    assert store.drop_holder("p", 2, "r0", "wiped")
    e = store.aliases["p"]
    assert e.replicas == ["r1"] and e.lagging["r0"].reason == "wiped"
    assert not store.drop_holder("p", 2, "r0", "again")
    # a version out of the window takes no holder
    assert not store.add_holder("p", 1, D1, "r2")


def _verdict(mean: float) -> CanaryVerdict:
    return CanaryVerdict(
        outcome="passed", mean_vs_trainer=mean, max_vs_trainer=mean, mean_vs_base=1.0,
        max_vs_base=2.0, tolerance=0.5, detail="",
    )  # fmt: skip


def test_canary_figures_follow_the_holders_and_survive_a_restart(tmp_path):
    store = AliasStore(tmp_path)
    # A figure for a replica that does not hold the version is not kept.
    figures = {"r0": _verdict(0.01), "r1": _verdict(0.02), "r9": _verdict(0.3)}
    store.set_alias("p", 1, "p@v1", ["r0", "r1"], digest=D1, canary=figures)
    (v1,) = store.aliases["p"].window()
    assert set(v1.canary) == {"r0", "r1"}
    # A catch-up adds its replica's figures; a claim for other bytes adds none.
    assert not store.add_holder("p", 1, D2, "r2", _verdict(0.03))
    assert store.add_holder("p", 1, D1, "r2", _verdict(0.03))
    # A replica that lost the version, or left, loses its figures with it.
    assert store.drop_holder("p", 1, "r0", "store wiped")
    store.forget_replica("r1", member=False)
    store = AliasStore(tmp_path)
    (v1,) = store.aliases["p"].window()
    assert v1.replicas == ["r2"]
    assert v1.canary == {"r2": _verdict(0.03)}
