"""The Publisher against real agents, reference engines and a router on loopback."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorafleet.bundle import AdapterBundle
from lorafleet.errors import (
    AdapterInvalid,
    PublishError,
    PublishInProgress,
    TransportError,
    VersionConflict,
)
from lorafleet.launch import Launcher
from lorafleet.publisher import Publisher
from lorafleet.testing import (
    ALL_LINEAR,
    greedy_completion,
    make_peft_adapter,
    make_peft_model,
    merged_greedy_ids,
    wait_until,
)
from tests.fleets import Fleet


def routed_greedy(router, model):
    status, ids, body = greedy_completion(router.url, model)
    assert status == 200, body
    return ids, body


def engine_greedy(engine, model):
    status, ids, _ = greedy_completion(engine.url, model)
    return status, ids


PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_peft_adapter(tiny_model, root / "a", r=8, seed=11),
        "b": make_peft_adapter(tiny_model, root / "b", r=8, seed=12),
        "big": make_peft_adapter(tiny_model, root / "big", r=32, seed=13),
    }


# Fleets shared by the module (each test publishes under its own name and ``forget``s it at the
# end); a test that kills, stops or restarts a process starts its own.


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory) -> Iterator[Launcher]:
    with Launcher(tmp_path_factory.mktemp("publish-logs")) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory) -> Path:
    """The directory the two-replica fleet's agents may register adapters from."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def _fleet2(module_launcher, make_fleet, shared_dir) -> Fleet:
    return make_fleet(module_launcher, 2, shared=shared_dir)


@pytest.fixture(scope="module")
def _fleet1(module_launcher, make_fleet) -> Fleet:
    return make_fleet(module_launcher, 1)


@pytest.fixture(scope="module")
def _mixed_fleet(module_launcher, make_fleet) -> Fleet:
    return make_fleet(module_launcher, 2, ranks=[64, 16])  # replica 1 cannot take rank 32


@pytest.fixture
def name(request) -> str:
    """This test's own adapter name on the shared fleets."""
    return "p-" + re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name.removeprefix("test_"))


@pytest.fixture
def fleet2(_fleet2, name) -> Iterator[Fleet]:
    """Two replicas (max rank 64, a shared directory) and a router, shared by the module."""
    yield _fleet2
    _fleet2.forget(name)


@pytest.fixture
def fleet1(_fleet1, name) -> Iterator[Fleet]:
    """One replica and a router, shared by the module."""
    yield _fleet1
    _fleet1.forget(name)


@pytest.fixture
def mixed_fleet(_mixed_fleet, name) -> Iterator[Fleet]:
    """Two replicas of max rank 64 and 16 and a router, shared by the module."""
    yield _mixed_fleet
    _mixed_fleet.forget(name)


def _alias(fleet, name):
    r = httpx.get(
        f"{fleet.router.url}/v1/control/aliases",
        headers={"Authorization": f"Bearer {fleet.token}"},
        timeout=10,
    )
    return r.json()["aliases"].get(name)


@pytest.mark.parametrize("transfer", ["remote_upload", "relay", "shared_filesystem", "in_memory"])
def test_transfer_modes_deliver_and_serve(fleet2, shared_dir, name, adapters, tiny_model, transfer):
    with Publisher(
        fleet2.agent_urls, router=fleet2.router.url, token=fleet2.token, shared_dir=shared_dir
    ) as pub:
        if transfer == "in_memory":
            source = make_peft_model(tiny_model, r=8, seed=11)
            res = pub.publish(source, name=name)
        else:
            source = str(adapters["a"])
            res = pub.publish(source, name=name, transfer=transfer)
    assert (res.version, res.active_version, res.engine_name) == (1, 1, f"{name}@v1")
    assert set(res.replicas) == {a.url.removeprefix("http://") for a in fleet2.agents}
    if transfer == "shared_filesystem":
        assert res.bytes_sent == 0
        # the agents ingested their own copies; the hand-over directory is gone
        assert not (shared_dir / name / "v1").exists()
    else:
        built = (
            AdapterBundle.from_peft_model(source, name="x")
            if transfer == "in_memory"
            else AdapterBundle.from_dir(adapters["a"], name="x")
        )
        # One copy per agent from here (the default on one host), or with relay one in all.
        copies = 1 if transfer == "relay" else 2
        assert res.transfer == ("remote_upload" if transfer == "in_memory" else transfer)
        assert res.bytes_sent == copies * built.total_size
        relayed = sorted(t.bytes_relayed for t in res.replicas.values())
        assert relayed == ([0, 0] if copies == 2 else [0, built.total_size])
    expected = merged_greedy_ids(tiny_model, adapters["a"], PROMPT, 8)
    routed, body = routed_greedy(fleet2.router, name)
    assert body["lorafleet"]["version"] == 1
    assert routed == expected
    for engine in fleet2.engines:  # each engine serves it directly, identically
        assert engine_greedy(engine, f"{name}@v1") == (200, expected)
    assert fleet2.staging_bytes() == [0, 0]


def test_republish_dedups_and_retires_old_version(fleet2, name, adapters):
    with Publisher(
        fleet2.agent_urls, router=fleet2.router.url, token=fleet2.token, retire_in_background=False
    ) as pub:
        r1 = pub.publish(str(adapters["a"]), name=name)
        r2 = pub.publish(str(adapters["a"]), name=name)  # same bytes, next version
        r3 = pub.publish(str(adapters["b"]), name=name)
    assert (r1.version, r2.version, r3.version) == (1, 2, 3)
    assert all(t.files_deduplicated == 2 and t.bytes_sent == 0 for t in r2.replicas.values())
    assert all(t.files_sent == 0 and 0 < t.open_s <= t.upload_s for t in r2.replicas.values())
    assert r2.retired_versions == [1] and r3.retired_versions == [2]
    # The breakdown accounts for the whole call: its steps, back to back, add up to it.
    for r in (r1, r2, r3):
        assert {"build", "begin", "stage", "cutover", "activate", "retire", "lease_release"} <= set(
            r.steps
        )
        assert 0 <= r.duration_s - sum(r.steps.values()) < 0.01 + 0.02 * r.duration_s, r.steps
        assert r.overhead_s == pytest.approx(r.duration_s - r.critical_s)
        assert r.steps["stage"] >= r.critical_s
    for i in range(2):
        held = {(a["name"], a["version"], a["state"]) for a in fleet2.adapters(i, name)}
        assert held == {(name, 3, "active")}
        assert f"{name}@v1" not in fleet2.engine_models(i)
    assert _alias(fleet2, name)["version"] == 3


async def _held_until(gate: threading.Event) -> None:
    """Hold a retirement (at most 30 s) until the test has looked."""
    for _ in range(3000):
        if gate.is_set():
            return
        await asyncio.sleep(0.01)


def test_the_flip_gives_the_lease_back_so_the_next_publisher_need_not_wait(fleet2, name, adapters):
    # Publisher A's retirement of v1 is held at its drain; meanwhile publisher B (another
    # holder, as another process would be) publishes v3 without a PublishInProgress.
    gate = threading.Event()
    with Publisher(
        fleet2.agent_urls, router=fleet2.router.url, token=fleet2.token, retire_in_background=True
    ) as a:
        router = a._async.router
        assert router is not None
        drain = router.drain
        held: list[int] = []

        async def gated_drain(n: str, v: int, wait: float):
            held.append(v)
            await _held_until(gate)
            return await drain(n, v, wait)

        router.drain = gated_drain  # type: ignore[method-assign]
        a.publish(str(adapters["a"]), name=name)
        a.publish(str(adapters["b"]), name=name)
        wait_until(lambda: held == [1], message="A's retirement held at v1's drain")
        with Publisher(
            fleet2.agent_urls,
            router=fleet2.router.url,
            token=fleet2.token,
            retire_in_background=False,
        ) as b:
            r3 = b.publish(str(adapters["a"]), name=name)
        assert r3.version == 3 and r3.retired_versions == [1, 2], r3.warnings
        assert held == [1]  # A's retirement was still held all along
        gate.set()
        _, late = a.retirements()
    # A's retirement, finishing after B's flip, left v3 alone: active on every replica.
    assert late.version == 2 and late.error is None, late
    for i in range(2):
        assert {(x["version"], x["state"]) for x in fleet2.adapters(i, name)} == {(3, "active")}
    assert _alias(fleet2, name)["version"] == 3
    assert routed_greedy(fleet2.router, name)[1]["lorafleet"]["version"] == 3


def test_retire_in_background_drains_before_release_and_reports_failures(fleet2, name, adapters):
    calls: list[tuple[str, int]] = []
    gate = threading.Event()
    fail_next_drain = threading.Event()
    with Publisher(
        fleet2.agent_urls,
        router=fleet2.router.url,
        token=fleet2.token,
        retire_in_background=True,
    ) as pub:
        inner = pub._async
        assert inner.router is not None
        drain, router = inner.router.drain, inner.router

        async def gated_drain(n: str, v: int, wait: float):
            calls.append(("drain", v))
            await _held_until(gate)
            if fail_next_drain.is_set():
                calls[-1] = ("drain failed", v)
                raise TransportError("the router went away")
            return await drain(n, v, wait)

        router.drain = gated_drain  # type: ignore[method-assign]
        for agent in inner._agents:
            unload = agent.client.unload

            async def logged_unload(n: str, v: int, _unload=unload):
                calls.append(("unload", v))
                return await _unload(n, v)

            agent.client.unload = logged_unload  # type: ignore[method-assign]

        r1 = pub.publish(str(adapters["a"]), name=name)
        r2 = pub.publish(str(adapters["b"]), name=name)
        assert r2.retired_versions == [] and r2.retire_s == 0.0
        assert "retire" not in r2.steps and "lease_release" not in r2.steps
        # publish() returned at the flip, with v1's drain still to come or held: nothing of
        # v1 is released before its drain is through.
        wait_until(lambda: calls, message="the retirement's drain")
        assert calls == [("drain", 1)]
        assert routed_greedy(fleet2.router, name)[1]["lorafleet"]["version"] == 2
        gate.set()
        first, retired = pub.retirements()
        assert (first.version, first.retired_versions, first.ok) == (1, [], True)
        assert (retired.version, retired.retired_versions, retired.ok) == (2, [1], True)
        assert calls == [("drain", 1), ("unload", 1), ("unload", 1)]
        for i in range(2):
            assert {(a["version"], a["state"]) for a in fleet2.adapters(i, name)} == {(2, "active")}
        # The lease was given back by the flip: another holder may take it.
        httpx.post(
            f"{fleet2.router.url}/v1/control/leases/{name}",
            json={"holder": "someone-else", "ttl_s": 1},
            headers={"Authorization": f"Bearer {fleet2.token}"},
        ).raise_for_status()
        httpx.delete(
            f"{fleet2.router.url}/v1/control/leases/{name}/someone-else",
            headers={"Authorization": f"Bearer {fleet2.token}"},
        ).raise_for_status()

        # A retirement that falls short: v2 is not released (not drained), and that is
        # reported by retirements() and in the next publication's warnings, not lost.
        gate.clear()
        fail_next_drain.set()
        r3 = pub.publish(str(adapters["a"]), name=name)
        assert r3.version == 3
        gate.set()
        [short] = pub.retirements()
        assert short.version == 3 and short.retired_versions == [] and not short.ok
        assert any("drain of v2 failed" in w for w in short.warnings), short.warnings
        fail_next_drain.clear()
        r4 = pub.publish(str(adapters["b"]), name=name)
        assert any("retirement after v3: drain of v2 failed" in w for w in r4.warnings)
    # Closing waited for the last retirement; every release came after a drain that went through.
    for i, (what, v) in enumerate(calls):
        if what == "unload":
            assert ("drain", v) in calls[:i], calls
    assert ("drain failed", 2) in calls and ("unload", 2) in calls
    for i in range(2):
        assert {(a["version"], a["state"]) for a in fleet2.adapters(i, name)} == {(4, "active")}
    assert r1.version == 1


def _assert_v1_still_serving_and_v2_nowhere(fleet, tiny_model, adapter_v1, name="policy"):
    expected = merged_greedy_ids(tiny_model, adapter_v1, PROMPT, 8)
    assert _alias(fleet, name)["version"] == 1
    for _ in range(4):
        routed, body = routed_greedy(fleet.router, name)
        assert body["lorafleet"]["version"] == 1 and routed == expected
    for i, engine in enumerate(fleet.engines):
        assert engine_greedy(engine, f"{name}@v1") == (200, expected)
        assert engine_greedy(engine, f"{name}@v2")[0] == 404
        assert {a["version"] for a in fleet.adapters(i, name)} == {1}
    assert fleet.staging_bytes() == [0] * len(fleet.agents)


def test_atomic_rollback_when_one_replica_refuses_rank(mixed_fleet, name, adapters, tiny_model):
    with Publisher(
        mixed_fleet.agent_urls, router=mixed_fleet.router.url, token=mixed_fleet.token
    ) as pub:
        pub.publish(str(adapters["a"]), name=name)
        with pytest.raises(PublishError) as err:
            pub.publish(str(adapters["big"]), name=name)
    bad = mixed_fleet.agents[1].url.removeprefix("http://")
    assert set(err.value.failures) == {bad}
    assert "rank 32" in err.value.failures[bad]
    assert "v1 keeps serving" in str(err.value)
    _assert_v1_still_serving_and_v2_nowhere(mixed_fleet, tiny_model, adapters["a"], name)


def test_atomic_rollback_when_a_replica_dies_mid_upload(launcher, make_fleet, tiny_model, tmp_path):
    fleet = make_fleet(launcher, 2)
    small = make_peft_adapter(tiny_model, tmp_path / "small", r=8, seed=21)
    # a bundle of a few MiB, so that the kill lands mid-stream (the client sends 1 MiB chunks)
    large = make_peft_model(
        tiny_model,
        r=64,
        seed=22,
        target_modules=ALL_LINEAR,
    )
    victim = fleet.agents[1]
    armed, killed = threading.Event(), threading.Event()

    def on_progress(replica, sent, total):
        if not armed.is_set() or killed.is_set():
            return
        if replica == victim.url.removeprefix("http://") and 0 < sent < total:
            killed.set()
            victim.proc.kill()

    with Publisher(
        fleet.agent_urls, router=fleet.router.url, token=fleet.token, on_progress=on_progress
    ) as pub:
        pub.publish(str(small), name="policy")
        armed.set()
        with pytest.raises(PublishError) as err:
            pub.publish(large, name="policy")
    assert killed.is_set()
    assert list(err.value.failures) == [victim.url.removeprefix("http://")]
    # the survivor holds nothing of v2 and no staging, right away
    assert {a["version"] for a in fleet.adapters(0)} == {1}
    assert fleet.staging_bytes()[0] == 0
    # the dead agent restarts on its data dir: stale staging is cleared, v1 is reinstalled
    fleet.restart_agent(1)
    _assert_v1_still_serving_and_v2_nowhere(fleet, tiny_model, small)


def test_in_place_fails_closed(mixed_fleet, name, adapters):
    with Publisher(mixed_fleet.agent_urls, token=mixed_fleet.token) as pub:
        res = pub.publish(str(adapters["a"]), name=name, mode="in_place")
        assert res.engine_name == name
        for e in mixed_fleet.engines:
            assert engine_greedy(e, name)[0] == 200
        with pytest.raises(PublishError) as err:
            pub.publish(str(adapters["big"]), name=name, mode="in_place")
    assert list(err.value.failures) == [mixed_fleet.agents[1].url.removeprefix("http://")]
    for i, e in enumerate(mixed_fleet.engines):  # the name is unloaded everywhere
        assert engine_greedy(e, name)[0] == 404
        assert name not in mixed_fleet.engine_models(i)
        assert mixed_fleet.adapters(i, name) == []
    assert mixed_fleet.staging_bytes() == [0, 0]


def test_in_place_upsert_replaces_weights(fleet1, name, adapters, tiny_model):
    with Publisher(fleet1.agent_urls, token=fleet1.token) as pub:
        pub.publish(str(adapters["a"]), name=name, mode="in_place")
        pub.publish(str(adapters["b"]), name=name, mode="in_place")
        assert engine_greedy(fleet1.engines[0], name) == (
            200,
            merged_greedy_ids(tiny_model, adapters["b"], PROMPT, 8),
        )
        # the replaced version keeps its files for one more publication, then goes
        held = {(a["version"], a["state"]) for a in fleet1.adapters(0, name)}
        assert held == {(1, "staged"), (2, "active")}
        pub.publish(str(adapters["a"]), name=name, mode="in_place")
    held = {(a["version"], a["state"]) for a in fleet1.adapters(0, name)}
    assert held == {(2, "staged"), (3, "active")}
    assert engine_greedy(fleet1.engines[0], name) == (
        200,
        merged_greedy_ids(tiny_model, adapters["a"], PROMPT, 8),
    )


def test_resumed_run_native_checkpoint_first_publish(fleet2, name, adapters, tiny_model):
    """Seed 004: engines start from base; the first publish installs a native-only checkpoint."""
    from safetensors.torch import load_file

    tensors = load_file(adapters["b"] / "adapter_model.safetensors")
    native = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    config = json.loads((adapters["b"] / "adapter_config.json").read_text())
    for e in fleet2.engines:
        assert engine_greedy(e, f"{name}@v1")[0] == 404  # fresh from base
    with Publisher(fleet2.agent_urls, router=fleet2.router.url, token=fleet2.token) as pub:
        res = pub.publish(native, name=name, config=config, version=30)
    assert res.version == 30
    routed, body = routed_greedy(fleet2.router, name)
    assert body["lorafleet"]["version"] == 30
    assert routed == merged_greedy_ids(tiny_model, adapters["b"], PROMPT, 8)


def test_stale_version_refused(fleet1, name, adapters):
    with Publisher(fleet1.agent_urls, router=fleet1.router.url, token=fleet1.token) as pub:
        pub.publish(str(adapters["a"]), name=name, version=5)
        for stale in (5, 3):
            with pytest.raises(VersionConflict, match="not newer"):
                pub.publish(str(adapters["b"]), name=name, version=stale)
    assert _alias(fleet1, name)["version"] == 5
    assert {a["version"] for a in fleet1.adapters(0, name)} == {5}


def test_concurrent_publishers_are_serialized(fleet1, name, adapters):
    headers = {"Authorization": f"Bearer {fleet1.token}"}
    # another publisher holds the name: this one gets a clear error and changes nothing
    r = httpx.post(
        f"{fleet1.router.url}/v1/control/leases/{name}",
        headers=headers,
        json={"holder": "trainer-B", "ttl_s": 60},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    with Publisher(fleet1.agent_urls, router=fleet1.router.url, token=fleet1.token) as pub:
        with pytest.raises(PublishInProgress, match="trainer-B"):
            pub.publish(str(adapters["a"]), name=name)
        assert fleet1.adapters(0, name) == [] and _alias(fleet1, name) is None
        httpx.delete(f"{fleet1.router.url}/v1/control/leases/{name}/trainer-B", headers=headers)

    # two publishers racing: versions never collide and nothing is silently overwritten
    results, errors = [], []

    def run(src):
        try:
            with Publisher(fleet1.agent_urls, router=fleet1.router.url, token=fleet1.token) as p:
                for _ in range(3):
                    results.append(p.publish(str(src), name=name).version)
        except PublishInProgress as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(adapters[k],)) for k in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(set(results))
    assert _alias(fleet1, name)["version"] == max(results)
    assert len(results) + len(errors) >= 4


def test_invalid_bundle_refused_before_any_byte(fleet1, name, adapters, tmp_path):
    bad = tmp_path / "dora"
    bad.mkdir()
    for f in ("adapter_model.safetensors",):
        (bad / f).write_bytes((adapters["a"] / f).read_bytes())
    cfg = json.loads((adapters["a"] / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with (
        Publisher(fleet1.agent_urls, router=fleet1.router.url, token=fleet1.token) as pub,
        pytest.raises(AdapterInvalid, match="DoRA"),
    ):
        pub.publish(str(bad), name=name)
    assert fleet1.adapters(0, name) == []


def test_unreachable_agent_fails_before_anything(launcher, make_fleet, adapters):
    fleet = make_fleet(launcher, 2)
    fleet.agents[1].proc.stop()
    with (
        Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub,
        pytest.raises(PublishError, match="unreachable"),
    ):
        pub.publish(str(adapters["a"]), name="policy")
    assert fleet.adapters(0) == []


def test_unreachable_router_is_a_publish_error_and_sends_nothing(launcher, make_fleet, adapters):
    fleet = make_fleet(launcher, 2)
    fleet.router.proc.stop()
    with (
        Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub,
        pytest.raises(PublishError, match="router is unreachable; nothing was sent") as err,
    ):
        pub.publish(str(adapters["a"]), name="policy")
    assert set(err.value.failures) == {"router"}
    assert fleet.adapters(0) == [] and fleet.adapters(1) == []
    assert fleet.staging_bytes() == [0, 0]


def test_rollback_leaves_another_publishers_version_alone(fleet1, name, adapters):
    """v2 on the agent belongs to someone else (other bytes): a publisher without the name's
    lease must not remove it, whatever fails. A lease holder at the router owns every version
    above the active one: it supersedes such a never-activated v2 (a crashed publication's
    leftover looks exactly like it; see test_heal_after_a_crash.py)."""
    import asyncio

    from lorafleet.clients.agent import AsyncAgentClient

    theirs = AdapterBundle.from_dir(adapters["b"], name=name, version=2)

    async def stage_theirs():
        async with AsyncAgentClient(fleet1.agents[0].url, fleet1.token) as c:
            s = await c.open_upload(theirs.manifest)
            for entry in theirs.files:
                await c.upload_file(s.upload_id, entry, theirs.source(entry.path))
            await c.commit(s.upload_id)

    with Publisher(fleet1.agent_urls, router=fleet1.router.url, token=fleet1.token) as pub:
        pub.publish(str(adapters["a"]), name=name)
    asyncio.run(stage_theirs())
    with Publisher(fleet1.agent_urls, token=fleet1.token) as no_lease, pytest.raises(PublishError):
        no_lease.publish(str(adapters["a"]), name=name, version=2, mode="in_place")
    held = {(a["version"], a["digest"]) for a in fleet1.adapters(0, name)}
    assert (2, theirs.digest) in held
    assert _alias(fleet1, name)["version"] == 1
    with Publisher(fleet1.agent_urls, router=fleet1.router.url, token=fleet1.token) as pub:
        ours = pub.publish(str(adapters["a"]), name=name, version=2)
    assert {(a["version"], a["digest"]) for a in fleet1.adapters(0, name)} == {(2, ours.digest)}


def test_in_place_failure_with_a_router_removes_the_alias(mixed_fleet, name, adapters):
    with Publisher(
        mixed_fleet.agent_urls, router=mixed_fleet.router.url, token=mixed_fleet.token
    ) as pub:
        pub.publish(str(adapters["a"]), name=name, mode="in_place")
        assert routed_greedy(mixed_fleet.router, name)[1]["lorafleet"]["version"] == 1
        with pytest.raises(PublishError):
            pub.publish(str(adapters["big"]), name=name, mode="in_place")
    assert _alias(mixed_fleet, name) is None
    status, _, body = greedy_completion(mixed_fleet.router.url, name)
    assert status == 404 and body["error"]["code"] == "not_found"


def test_cancelled_publication_rolls_back(fleet2, name, tiny_model, tmp_path):
    """Cancelling apublish mid-upload (a caller's timeout, a shutdown) leaves nothing behind."""
    import asyncio

    from lorafleet.publisher import AsyncPublisher

    small = make_peft_adapter(tiny_model, tmp_path / "small", r=8, seed=61)
    large = make_peft_model(tiny_model, r=64, seed=62, target_modules=ALL_LINEAR)

    async def run():
        mid_upload = asyncio.Event()

        def on_progress(replica, sent, total):
            if 0 < sent < total:
                mid_upload.set()

        async with AsyncPublisher(
            fleet2.agent_urls, router=fleet2.router.url, token=fleet2.token, on_progress=on_progress
        ) as pub:
            await pub.apublish(str(small), name=name)
            mid_upload.clear()
            task = asyncio.ensure_future(pub.apublish(large, name=name))
            await mid_upload.wait()
            task.cancel()  # as a caller's timeout would
            # Cancellation normally propagates; if every replica had already turned it into a
            # failure of its own, the publication fails instead. Either way it rolled back.
            with pytest.raises((asyncio.CancelledError, PublishError)):
                await task

    asyncio.run(run())
    assert _alias(fleet2, name)["version"] == 1
    for i in range(2):
        assert {a["version"] for a in fleet2.adapters(i, name)} == {1}
    assert fleet2.staging_bytes() == [0, 0]
    # the lease was released: the next publication goes through (as v3 if a replica had been
    # asked to load the cancelled v2 before the cancel: issue 26 burns that number)
    with Publisher(fleet2.agent_urls, router=fleet2.router.url, token=fleet2.token) as pub:
        assert pub.publish(str(small), name=name).version in (2, 3)
