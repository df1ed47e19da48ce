"""Publications at once: several on one Publisher, and a publisher that lost its lease.

Each publication keeps its own state (upload sessions, timings, what to roll back), so calls for
different names on one Publisher cannot see each other's; calls for one name queue and run as if
made one after another.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from lorafleet.bundle import AdapterBundle
from lorafleet.errors import PublishInProgress, VersionConflict
from lorafleet.publisher import AsyncPublisher, Publisher, ReplicaState
from lorafleet.testing import ALL_LINEAR, greedy_completion, make_peft_adapter


def _headers(fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.token}"}


def _aliases(fleet) -> dict:
    r = httpx.get(f"{fleet.router.url}/v1/control/aliases", headers=_headers(fleet), timeout=10)
    r.raise_for_status()
    return r.json()


def _held(fleet, i: int) -> set[tuple[str, int, str, str]]:
    return {(a["name"], a["version"], a["state"], a["digest"]) for a in fleet.adapters(i)}


def test_two_names_at_once_on_one_publisher_stay_apart(launcher, make_fleet, tiny_model, tmp_path):
    fleet = make_fleet(launcher, 2)
    # Several MiB each, of different sizes, so that the two uploads overlap and are told apart.
    paths = {
        "alpha": make_peft_adapter(
            tiny_model, tmp_path / "alpha", r=64, seed=81, target_modules=ALL_LINEAR
        ),
        "beta": make_peft_adapter(
            tiny_model, tmp_path / "beta", r=32, seed=82, target_modules=ALL_LINEAR
        ),
    }
    bundles = {n: AdapterBundle.from_dir(p, name=n) for n, p in paths.items()}
    by_size = {b.total_size: n for n, b in bundles.items()}
    assert len(by_size) == 2
    events: list[str] = []  # which publication each progress report belongs to, in order

    def on_progress(replica: str, sent: int, total: int) -> None:
        events.append(by_size[total])

    async def run():
        async with AsyncPublisher(
            fleet.agent_urls, router=fleet.router.url, token=fleet.token, on_progress=on_progress
        ) as pub:
            return await asyncio.gather(
                pub.apublish(str(paths["alpha"]), name="alpha"),
                pub.apublish(str(paths["beta"]), name="beta"),
            )

    alpha, beta = asyncio.run(run())
    # the uploads did run at the same time: each one reported progress while the other ran
    first = {n: events.index(n) for n in bundles}
    last = {n: len(events) - 1 - events[::-1].index(n) for n in bundles}
    assert first["alpha"] < last["beta"] and first["beta"] < last["alpha"], events

    for res, name in ((alpha, "alpha"), (beta, "beta")):
        size = bundles[name].total_size
        assert (res.name, res.version, res.engine_name) == (name, 1, f"{name}@v1")
        assert res.digest == bundles[name].digest
        assert res.bytes_sent == 2 * size
        for timing in res.replicas.values():
            assert (timing.state, timing.bytes_sent, timing.files_sent) == (
                ReplicaState.ACTIVE,
                size,
                len(bundles[name].files),
            )
    for rid in alpha.replicas:
        assert alpha.replicas[rid] is not beta.replicas[rid]

    aliases = _aliases(fleet)["aliases"]
    assert {n: aliases[n]["version"] for n in ("alpha", "beta")} == {"alpha": 1, "beta": 1}
    for i in range(2):
        assert _held(fleet, i) == {
            ("alpha", 1, "active", bundles["alpha"].digest),
            ("beta", 1, "active", bundles["beta"].digest),
        }
    assert fleet.staging_bytes() == [0, 0]
    for name in ("alpha", "beta"):
        status, _, body = greedy_completion(fleet.router.url, name)
        assert status == 200 and body["lorafleet"]["version"] == 1, body


def test_one_name_at_once_on_one_publisher_runs_in_turn(launcher, make_fleet, tiny_model, tmp_path):
    fleet = make_fleet(launcher, 2)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=83)
    b = make_peft_adapter(tiny_model, tmp_path / "b", r=16, seed=84)

    def race(pub: Publisher, **kwargs) -> tuple[list, list[BaseException]]:
        """Two threads call ``pub.publish`` of one name at the same moment."""
        start = threading.Barrier(2)
        results, errors = [], []

        def one(src) -> None:
            start.wait()
            try:
                results.append(pub.publish(str(src), name="policy", **kwargs))
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(src,)) for src in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, errors

    with Publisher(
        fleet.agent_urls, router=fleet.router.url, token=fleet.token, retire_in_background=False
    ) as pub:
        pub.publish(str(a), name="policy")
        # version=None: both succeed, each with the next version, as if called in sequence
        results, errors = race(pub)
        assert errors == []
        first, second = sorted(results, key=lambda r: r.version)
        assert (first.version, second.version) == (2, 3)
        assert (first.retired_versions, second.retired_versions) == ([1], [2])
        assert [e["version"] for e in _aliases(fleet)["log"]] == [1, 2, 3]
        for i in range(2):
            assert _held(fleet, i) == {("policy", 3, "active", second.digest)}

        # the same explicit version twice: the second call, coming after the first, is refused
        results, errors = race(pub, version=5)
        assert [r.version for r in results] == [5]
        assert len(errors) == 1 and isinstance(errors[0], VersionConflict), errors
        assert "not newer than the active version 5" in str(errors[0])
    assert _aliases(fleet)["aliases"]["policy"]["version"] == 5
    for i in range(2):
        assert _held(fleet, i) == {("policy", 5, "active", results[0].digest)}
    assert fleet.staging_bytes() == [0, 0]
    status, _, body = greedy_completion(fleet.router.url, "policy")
    assert status == 200 and body["lorafleet"]["version"] == 5, body


def test_flip_refused_after_the_lease_was_lost(launcher, make_fleet, tiny_model, tmp_path):
    """Mid-publication, the lease passes to another holder (as after an expiry): the router
    refuses the flip, and the publication rolls back and says who holds the name."""
    fleet = make_fleet(launcher, 1)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=85)
    b = make_peft_adapter(tiny_model, tmp_path / "b", r=8, seed=86)
    leases = f"{fleet.router.url}/v1/control/leases/policy"
    taken = threading.Event()

    def on_progress(replica: str, sent: int, total: int) -> None:
        if not armed.is_set() or taken.is_set():
            return
        taken.set()
        r = httpx.delete(f"{leases}/trainer-A", headers=_headers(fleet), timeout=10)
        assert r.status_code == 204, r.text
        r = httpx.post(
            leases, headers=_headers(fleet), json={"holder": "trainer-B", "ttl_s": 60}, timeout=10
        )
        assert r.status_code == 200, r.text

    armed = threading.Event()
    with Publisher(
        fleet.agent_urls,
        router=fleet.router.url,
        token=fleet.token,
        holder="trainer-A",
        on_progress=on_progress,
    ) as pub:
        pub.publish(str(a), name="policy")
        armed.set()
        with pytest.raises(PublishInProgress, match="trainer-B") as err:
            pub.publish(str(b), name="policy")
    assert taken.is_set()
    assert "at the router's alias flip" in str(err.value)
    assert "v1 keeps serving" in str(err.value)
    assert set(err.value.failures) == {"router"}
    assert _aliases(fleet)["aliases"]["policy"]["version"] == 1
    assert {(x["version"], x["state"]) for x in fleet.adapters(0)} == {(1, "active")}
    assert fleet.staging_bytes() == [0]
