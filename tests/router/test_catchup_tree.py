"""Catch-up through relay trees (docs/transfer.md): replicas that lose a version together (a
rack back, stores wiped) are fed by trees of peers, each copy verified by its own agent, not
by one peer each and never by the trainer.

Six reference replicas behind a router; a version published to all; five stores wiped at once
and their agents restarted empty. The five are caught up; the lagging agents forwarded copies
to each other (a tree), the router counted its trees, and every replica answers as before.
"""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest

from lorafleet.launch import Launcher
from lorafleet.protocol.relay import RelayRates
from lorafleet.publisher import Publisher
from lorafleet.testing import ALL_LINEAR, make_peft_adapter, wait_until

pytestmark = pytest.mark.timeout(900)

N = 6


def _metric(url: str, key: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(key))


def test_five_wiped_replicas_catch_up_through_a_tree(make_fleet, tiny_model, tmp_path):
    adapter = make_peft_adapter(
        tiny_model, tmp_path / "adapter", r=64, seed=91, target_modules=ALL_LINEAR
    )
    with Launcher(tmp_path / "logs") as launcher:
        fleet = make_fleet(launcher, N, replica_ids=True)
        with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
            res = pub.publish(str(adapter), name="treeup")
        before = {
            i: httpx.post(
                fleet.engines[i].url + "/v1/completions",
                json={"model": "treeup@v1", "prompt": "The capital of", "max_tokens": 4,
                      "temperature": 0},
                timeout=60,
            ).json()["choices"][0]["text"]
            for i in range(N)
        }  # fmt: skip
        assert len(set(before.values())) == 1
        wiped = list(range(1, N))
        for i in wiped:
            fleet.agents[i].proc.stop()
        for i in wiped:
            shutil.rmtree(fleet.agents[i].spec.data_dir)
        for i in wiped:
            launcher.restart(fleet.agents[i], wait=False)
        for i in wiped:
            launcher.wait_ready(fleet.agents[i])
        # What `lorafleet status` shows while it runs: the trees and their progress.
        seen: list[dict] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                r = httpx.get(
                    fleet.router.url + "/v1/control/catch-up",
                    headers={"Authorization": f"Bearer {fleet.token}"},
                    timeout=10,
                )
                seen.extend(r.json()["trees"])
                stop.wait(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        def caught_up() -> bool:
            holders = fleet.aliases()["treeup"]["routable"][0]["replicas"]
            held = all(
                any(a["state"] in ("loaded", "active") for a in fleet.adapters(i, "treeup"))
                for i in range(N)
            )
            return held and len(holders) == N

        try:
            wait_until(caught_up, timeout=240, message="every wiped replica caught up")
        finally:
            stop.set()
            watcher.join(10)
        assert any(t["name"] == "treeup" and t["replicas"] >= 2 for t in seen), seen[:3]
        trees = _metric(fleet.router.url, "lorafleet_router_catch_up_trees_total")
        forwarded = sum(
            _metric(fleet.agents[i].url, 'lorafleet_agent_relay_hops_total{outcome="ok"}')
            for i in wiped
        )
        assert trees >= 1, trees
        # Each tree that landed whole was timed, and the next one is planned from what it took.
        status = httpx.get(
            fleet.router.url + "/v1/control/catch-up",
            headers={"Authorization": f"Bearer {fleet.token}"},
            timeout=10,
        ).json()
        assert status["learned_from"] >= 1, status
        assert status["relay_rates"]["hop_s"] != RelayRates().hop_s, status
        # Lagging replicas fed each other: a copy moved agent to agent below the source peer.
        assert forwarded >= 1, forwarded
        for i in range(N):
            rec = [a for a in fleet.adapters(i, "treeup") if a["version"] == 1]
            assert rec and rec[0]["digest"] == res.digest
            r = httpx.post(
                fleet.engines[i].url + "/v1/completions",
                json={"model": "treeup@v1", "prompt": "The capital of", "max_tokens": 4,
                      "temperature": 0},
                timeout=60,
            )  # fmt: skip
            assert r.json()["choices"][0]["text"] == before[0]
        assert fleet.staging_bytes() == [0] * N
