"""More adapter names than engine slots (docs/placement.md), on reference engines.

Two replicas with 2 adapter slots each (4 in the fleet) take 6 names, published one after the
other: a full replica's least recently used version is evicted (drained first, its verified
files kept) to make room. A request for a name placed nowhere any more (cold) loads it on demand
from an agent's store, proves it and serves it. Under a skewed (Zipf) mix of the 6 names sent
4 at a time, every answer is a 200 tagged with its own adapter and version, each output equals
what that adapter answered when it was first published, and no engine ever holds more than its
slots.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lorafleet.launch import Launcher
from lorafleet.protocol.placement import rendezvous
from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, start_dataplane, wait_until
from tests.fleets import Fleet

pytestmark = pytest.mark.timeout(600)

SLOTS = 2
NAMES = [f"tenant-{i}" for i in range(6)]
PROMPT = "The capital of"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_fleet) -> Iterator[Fleet]:
    with Launcher(tmp_path_factory.mktemp("placement-logs")) as launcher:
        yield make_fleet(launcher, 2, max_loras=SLOTS)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(tiny_model, root / name, r=8, seed=100 + i)
        for i, name in enumerate(NAMES)
    }


def _complete(fleet: Fleet, model: str) -> httpx.Response:
    return httpx.post(
        fleet.router.url + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )


def _metric(url: str, key: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(key + " ")), 0.0)


def _evictions(fleet: Fleet, i: int) -> float:
    return _metric(fleet.agents[i].url, "lorafleet_agent_evictions_total")


def test_six_names_on_four_slots_are_published_and_served_under_a_zipf_mix(fleet, adapters):
    expected: dict[str, str] = {}
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        for name in NAMES:
            result = pub.publish(str(adapters[name]), name=name)
            assert result.version == 1
            r = _complete(fleet, name)
            assert r.status_code == 200, r.text
            expected[name] = r.json()["choices"][0]["text"]
            for i in range(len(fleet.agents)):
                assert len(fleet.in_engine(i)) <= SLOTS
    assert len(set(expected.values())) > 1, "the adapters should answer differently"
    evicted = sum(_evictions(fleet, i) for i in range(len(fleet.agents)))
    assert evicted >= len(NAMES) - SLOTS
    assert _metric(fleet.router.url, "lorafleet_router_evictions_total") == evicted
    cold = [
        n
        for n in NAMES
        if _metric(
            fleet.router.url, f'lorafleet_router_version_replicas{{adapter="{n}",version="1"}}'
        )
        == 0
    ]
    assert cold, "with 4 slots for 6 names, some name is placed nowhere"

    # A skewed mix, 4 at a time: the popular names stay placed, the tail is loaded on demand.
    rng = random.Random(7)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(NAMES))]
    mix = rng.choices(NAMES, weights=weights, k=60)

    with fleet.watch_slots(SLOTS) as over, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda name: (name, _complete(fleet, name)), mix))
    for name, r in answers:
        assert r.status_code == 200, (name, r.status_code, r.text)
        tag = r.json()["lorafleet"]
        assert (tag["adapter"], tag["version"]) == (name, 1), tag
        assert r.json()["choices"][0]["text"] == expected[name], name
    assert not over, f"an engine held more than {SLOTS} adapters: {over[:3]}"
    loads = 'lorafleet_router_on_demand_loads_total{outcome="%s",why="cold"}'
    assert _metric(fleet.router.url, loads % "ok") >= len(cold)
    assert _metric(fleet.router.url, loads % "failed") == 0
    # Every version is still whole somewhere: nothing evicted lost its verified files.
    for name in NAMES:
        stored = [a for i in range(len(fleet.agents)) for a in fleet.adapters(i, name)]
        assert stored and all(a["version"] == 1 for a in stored), stored


def test_the_router_lists_only_the_replicas_that_hold_a_version(fleet, adapters):
    """After the mix, the table's holders are exactly the replicas whose engines hold each name,
    and a name evicted everywhere is listed with no holder (cold) until it is asked for."""
    table = httpx.get(
        fleet.router.url + "/v1/control/aliases",
        params={"log": "false"},
        headers={"Authorization": f"Bearer {fleet.token}"},
        timeout=10,
    ).json()["aliases"]
    for name in NAMES:
        (v1,) = table[name]["routable"]
        holding = {
            fleet.agents[i].url.removeprefix("http://")
            for i in range(len(fleet.agents))
            if f"{name}@v1" in fleet.in_engine(i)
        }
        assert set(v1["replicas"]) == holding, (name, v1["replicas"], holding)


def _table(fleet: Fleet) -> dict:
    return fleet.aliases()


def _cold_names(fleet: Fleet) -> list[str]:
    table = _table(fleet)
    return [n for n in NAMES if not table[n]["routable"][0]["replicas"]]


def test_a_data_plane_copy_loads_a_cold_name_and_one_past_its_bound_says_retry(fleet, adapters):
    """A copy (``lorafleet dataplane``) asks its control plane to place a cold name and serves it
    once its own table lists a holder; a copy whose ``--cold-wait`` is 0 answers 503
    ``adapter_cold`` with ``Retry-After`` at once, and serves the name once the load it started
    has finished."""
    expected = {}
    for name in NAMES:  # what each adapter answers (placed now or on demand)
        r = _complete(fleet, name)
        assert r.status_code == 200, r.text
        expected[name] = r.json()["choices"][0]["text"]
    waits = start_dataplane(fleet.launcher, fleet.router, token=fleet.token, health_interval=0.2)
    hurried = start_dataplane(fleet.launcher, fleet.router, token=fleet.token,
                              health_interval=0.2, extra=("--cold-wait", "0"))  # fmt: skip

    def via(copy, name: str) -> httpx.Response:
        return httpx.post(
            copy.url + "/v1/completions",
            json={"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
            timeout=120,
        )

    first = _cold_names(fleet)[0]
    r = via(waits, first)
    assert r.status_code == 200, r.text
    assert r.json()["lorafleet"]["adapter"] == first
    assert r.json()["choices"][0]["text"] == expected[first]

    second = next(n for n in _cold_names(fleet) if n != first)
    r = via(hurried, second)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "adapter_cold"
    assert int(r.headers["Retry-After"]) >= 1
    served = wait_until(
        lambda: (x := via(hurried, second)).status_code == 200 and x,
        timeout=120,
        message=f"{second} served once its on-demand load finished",
    )
    assert served.json()["choices"][0]["text"] == expected[second]


def test_a_placement_set_holds_every_version_of_its_name(fleet, adapters):
    """``max_replicas=1``: each version of the name goes to the one replica rendezvous hashing
    ranks first for it (the same one every time), the table records that placement set, and the
    name is served from there."""
    name = "placed-once"
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        first = pub.publish(str(adapters[NAMES[0]]), name=name, max_replicas=1)
        second = pub.publish(str(adapters[NAMES[1]]), name=name, max_replicas=1)
    ids = sorted(a.url.removeprefix("http://") for a in fleet.agents)
    chosen = rendezvous(name, ids)[0]
    assert set(first.replicas) == set(second.replicas) == {chosen}
    entry = _table(fleet)[name]
    assert entry["placement"] == [chosen]
    assert entry["routable"][0]["replicas"] == [chosen]
    r = _complete(fleet, name)
    assert r.status_code == 200, r.text
    assert r.json()["lorafleet"] == {**r.json()["lorafleet"], "adapter": name, "version": 2}
    assert r.json()["lorafleet"]["replica"] == chosen


def test_a_name_whose_queue_grows_gets_one_more_replica(fleet, adapters):
    """Published on one replica (``max_replicas=1``); a data-plane copy started with
    ``--grow-at 1`` sees requests of it queue on that replica and asks the control plane for
    one more: the other replica loads it (making room), and the table lists both."""
    name = "grows"
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        pub.publish(str(adapters[NAMES[2]]), name=name, max_replicas=1)
    assert len(_table(fleet)[name]["routable"][0]["replicas"]) == 1
    copy = start_dataplane(fleet.launcher, fleet.router, token=fleet.token, health_interval=0.2,
                           extra=("--grow-at", "1"))  # fmt: skip

    def burst() -> list[httpx.Response]:
        def one(_: int) -> httpx.Response:
            return httpx.post(
                copy.url + "/v1/completions",
                json={"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                timeout=120,
            )

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, range(8)))

    def grown() -> bool:
        answers = burst()
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        return len(_table(fleet)[name]["routable"][0]["replicas"]) == len(fleet.agents)

    wait_until(grown, timeout=120, message=f"{name} held by every replica")
    more = 'lorafleet_router_on_demand_loads_total{outcome="ok",why="more"}'
    assert _metric(fleet.router.url, more) >= 1


def test_an_on_demand_load_is_proven_by_the_canary_it_was_published_with(fleet, tiny_model):
    """A version published with the trainer's canary on one replica, evicted from it (the
    router's room route, as a publication of other names would), is loaded again by the next
    request for it and judged by that canary there; the router's table keeps the figures."""
    from lorafleet.publisher.canary import compute_canary
    from lorafleet.testing import make_peft_model

    model = make_peft_model(tiny_model, r=8, lora_alpha=16, seed=41)
    canary = compute_canary(model, n=2)
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        (rid,) = pub.publish(model, name="proven", canary=canary, max_replicas=1).replicas
    auth = {"Authorization": f"Bearer {fleet.token}"}
    room = httpx.post(
        f"{fleet.router.url}/v1/control/replicas/{rid}/room",
        json={"need": SLOTS},
        headers=auth,
        timeout=120,
    )
    # Every slot there freed, or as many as could be: a load under way there (catch-up, or a
    # load on demand) holds its slot and is never pulled from under it (409 no_room then).
    assert room.status_code in (200, 409), room.text
    assert "proven@v1" in room.text, room.text
    assert _table(fleet)["proven"]["routable"][0]["replicas"] == []
    r = _complete(fleet, "proven")
    assert r.status_code == 200, r.text
    (v1,) = _table(fleet)["proven"]["routable"]
    assert v1["replicas"], v1
    for holder in v1["replicas"]:
        assert v1["canary"][holder]["outcome"] == "passed", v1["canary"]
