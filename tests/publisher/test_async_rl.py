"""Asynchronous RL: publish every step while rollouts run, with a retention window of K = 3.

Rollout "episodes" are sessions of several turns (``X-Session-ID``); other requests pin a version
explicitly (``policy@vN``). Every response must come from the version asked for (pins) or the one
the session started on (sessions); no request may fail; served versions stay within the
staleness bound; and when it is over, the versions that left the window are gone from every
agent, engine first and files after, while the K newest are all there.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter

pytestmark = pytest.mark.timeout(600)

K = 3
PUBLICATIONS = 8


def _tag(r: httpx.Response) -> int | None:
    return r.json()["lorafleet"]["version"] if r.status_code == 200 else None


def test_k_versions_routable_while_publishing_under_load(
    launcher, make_fleet, tiny_model, tmp_path
):
    fleet = make_fleet(launcher, 2)
    adapters = [
        make_peft_adapter(tiny_model, tmp_path / f"a{i}", r=8, seed=90 + i) for i in range(3)
    ]
    url = fleet.router.url
    done = threading.Event()
    published: list[int] = []
    errors: list[BaseException] = []

    def trainer(pub: Publisher) -> None:
        try:
            for i in range(PUBLICATIONS):
                r = pub.publish(str(adapters[i % 3]), name="policy", keep_versions=K)
                published.append(r.version)
                assert r.routable_versions == list(range(r.version, max(0, r.version - K), -1))
                time.sleep(0.5)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    async def rollouts() -> tuple[list, list]:
        episodes, pins = [], []
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def episode(i: int) -> None:
                seen = []
                for turn in range(3):
                    body = {"model": "policy", "prompt": f"turn {turn}", "max_tokens": 2}
                    r = await client.post(
                        "/v1/completions", json=body, headers={"X-Session-ID": f"ep-{i}"}
                    )
                    seen.append((r.status_code, _tag(r), r.text[:200]))
                episodes.append(seen)

            async def pinned() -> None:
                models = (await client.get("/v1/models")).json()["data"]
                versions = next(m["versions"] for m in models if m["id"] == "policy")
                v = random.choice(versions[:2])  # newest or the one before: in the window
                body = {"model": f"policy@v{v}", "prompt": "pinned", "max_tokens": 2}
                r = await client.post("/v1/completions", json=body)
                pins.append((v, r.status_code, _tag(r), r.json().get("model"), r.text[:200]))

            i = 0
            while not done.is_set():
                await asyncio.gather(episode(i), episode(i + 1), pinned(), pinned())
                i += 2
        return episodes, pins

    with Publisher(fleet.agent_urls, router=url, token=fleet.token) as pub:
        pub.publish(str(adapters[0]), name="policy", keep_versions=K)
        worker = threading.Thread(target=trainer, args=(pub,))
        worker.start()
        episodes, pins = asyncio.run(rollouts())
        worker.join()
    assert not errors, errors
    assert published == list(range(2, PUBLICATIONS + 2))

    assert episodes and pins
    for turns in episodes:
        assert all(status == 200 for status, _, _ in turns), turns  # no failed request
        assert len({v for _, v, _ in turns}) == 1, turns  # an episode never switches version
    for v, status, served, model, text in pins:
        assert status == 200 and served == v and model == f"policy@v{v}", text  # exact pins
    assert len({v for turns in episodes for _, v, _ in turns}) > 2  # versions did move on

    lag = httpx.get(url + "/metrics").text
    total = next(
        line
        for line in lag.splitlines()
        if line.startswith('lorafleet_router_version_lag_count{adapter="policy"}')
    )
    within = next(line for line in lag.splitlines() if line.startswith(
        f'lorafleet_router_version_lag_bucket{{adapter="policy",le="{K - 1}.0"}}'))  # fmt: skip
    assert float(total.split()[-1]) == float(within.split()[-1]) > 0  # all within K - 1

    newest = PUBLICATIONS + 1
    window = set(range(newest - K + 1, newest + 1))
    for i, agent in enumerate(fleet.agents):
        assert {a["version"] for a in fleet.adapters(i)} == window
        on_disk = {int(p.name) for p in (agent.spec.data_dir / "adapters" / "policy").iterdir()
                   if p.name.isdigit()}  # fmt: skip
        assert on_disk == window
        engine = httpx.get(fleet.engines[i].url + "/v1/models").json()["data"]
        assert {m["id"] for m in engine if m.get("parent")} == {f"policy@v{v}" for v in window}


def test_a_window_a_replica_cannot_hold_is_refused_before_any_byte(
    launcher, make_fleet, tiny_model, tmp_path
):
    """3 engine slots: K = 3 needs 4 during a publication (the window plus the new version)."""
    from lorafleet.errors import PublishError

    fleet = make_fleet(launcher, 2, max_loras=3)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=5)
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        with pytest.raises(PublishError, match="no room") as err:
            pub.publish(str(a), name="policy", keep_versions=3)
        assert set(err.value.failures) == {f"{x.host}:{x.port}" for x in fleet.agents}
        assert "at most 3 adapters" in next(iter(err.value.failures.values()))
        for agent in fleet.agents:  # nothing was sent anywhere
            metrics = httpx.get(agent.url + "/metrics").text
            assert "lorafleet_agent_upload_bytes_total 0.0" in metrics
        assert pub.publish(str(a), name="policy", keep_versions=2).routable_versions == [1]
