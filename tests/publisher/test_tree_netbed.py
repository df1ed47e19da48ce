"""Relay trees on shaped links (docs/transfer.md): 8 replica hosts and a trainer host in network
namespaces, each host's egress limited to 100 Mbit/s, an 8 MiB adapter.

1. A publication leaves the trainer once: the Publisher counts exactly one copy sent, and the
   trainer's link carries about one copy.
2. A hop killed mid-stream: its subtree is re-parented onto a replica with a verified copy, the
   publication (quorum 7 of 8) succeeds with every other replica verified, and still exactly one
   copy left the trainer.
3. Six replicas wiped at once (and the killed one back): they catch up through relay trees of
   peers, and no adapter byte crosses the trainer's link (where the router runs).

Needs root and network namespaces; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from lorafleet.agent.config import AgentSettings
from lorafleet.bundle import AdapterBundle
from lorafleet.launch import Launcher
from lorafleet.testing import ALL_LINEAR, make_peft_model, netbed, wait_until

pytestmark = [
    pytest.mark.skipif(netbed.netns_available() is not None, reason=str(netbed.netns_available())),
    pytest.mark.timeout(900),
]

N = 8
RATE = "100mbit"
LINK_BYTES_PER_S = 100e6 / 8
RANK = 512  # all-linear on the tiny model: 8 MiB

# Run in the trainer's namespace: publish with the bed's link rate (a chain is the tree that
# the planner picks for 8 replicas on 100 Mbit/s links), print the result.
PUBLISH = """
import dataclasses, json, os, sys
from lorafleet.protocol.relay import RelayRates
from lorafleet.publisher import Publisher

agents, router, adapter, quorum, link = json.loads(sys.argv[1])
token = os.environ["NETBED_TOKEN"]
with Publisher(agents, router, token=token, relay_stall_s=3,
               relay_rates=RelayRates(link_Bps=link)) as pub:
    result = pub.publish(adapter, name="policy", transfer="relay", min_replicas=quorum)
print(json.dumps(dataclasses.asdict(result)))
"""


def _publish(bed, replicas, router, adapter: Path, quorum: int | None) -> subprocess.Popen:
    args = [[r.url for r in replicas], router.url, str(adapter), quorum, LINK_BYTES_PER_S]
    return subprocess.Popen(
        ["ip", "netns", "exec", bed.trainer.ns, sys.executable, "-c", PUBLISH, json.dumps(args)],
        env={**os.environ, "NETBED_TOKEN": replicas[0].agent.spec.token},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _staged(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / "staging").rglob("*.partial") if p.is_file())


def _held(bed, replica, token: str, version: int, digest: str) -> bool:
    """Whether ``replica``'s agent holds the version loaded (asked from the trainer's host)."""
    with bed.inside(bed.trainer):
        r = httpx.get(
            replica.url + "/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
    return any(
        a["name"] == "policy"
        and a["version"] == version
        and a["digest"] == digest
        and a["state"] in ("loaded", "active")
        for a in r.json()["adapters"]
    )


def test_trees_on_shaped_links(tiny_model, tmp_path):
    adapters = []
    for seed in range(2):
        adapters.append(tmp_path / f"adapter{seed}")
        model = make_peft_model(tiny_model, r=RANK, seed=70 + seed, target_modules=ALL_LINEAR)
        model.save_pretrained(adapters[-1])
    sizes = [AdapterBundle.from_dir(a, name="x").total_size for a in adapters]
    data = tmp_path / "data"
    with netbed.NetBed(N, rate=RATE) as bed, Launcher(tmp_path / "logs") as launcher:
        replicas = netbed.start_replicas(
            bed, launcher, tiny_model, data,
            engine_kwargs={"max_lora_rank": RANK}, settings=AgentSettings(max_lora_rank=RANK),
        )  # fmt: skip
        token = replicas[0].agent.spec.token
        router = netbed.start_router(bed, launcher, replicas, token=token, health_interval=0.2)

        # 1. One copy leaves the trainer.
        before = bed.tx_bytes(bed.trainer)
        first = _result(_publish(bed, replicas, router, adapters[0], None))
        egress = bed.tx_bytes(bed.trainer) - before
        assert first["version"] == 1 and first["transfer"] == "relay"
        assert first["bytes_sent"] == sizes[0]
        assert egress < 1.2 * sizes[0], egress / sizes[0]
        assert all(_held(bed, r, token, 1, first["digest"]) for r in replicas)

        # 2. Replica 1 (second in the chain: its subtree is the 6 below it) killed mid-stream.
        killed = threading.Event()
        victim = replicas[1]

        def kill_when_streaming() -> None:
            wait_until(
                lambda: _staged(data / victim.host.name) > 1 << 20,
                timeout=120,
                message="replica 1 receives",
            )
            victim.agent.proc.kill()
            killed.set()

        killer = threading.Thread(target=kill_when_streaming, daemon=True)
        before = bed.tx_bytes(bed.trainer)
        proc = _publish(bed, replicas, router, adapters[1], N - 1)
        killer.start()
        second = _result(proc)
        killer.join(30)
        egress = bed.tx_bytes(bed.trainer) - before
        assert killed.is_set()
        assert second["version"] == 2
        assert second["bytes_sent"] == sizes[1] - first_config_size(adapters), second
        assert egress < 1.2 * sizes[1], egress / sizes[1]
        survivors = [r for r in replicas if r is not victim]
        assert all(_held(bed, r, token, 2, second["digest"]) for r in survivors)
        relayed = {rid: t["bytes_relayed"] for rid, t in second["replicas"].items()}
        assert sum(relayed.values()) > 0, relayed

        # 3. Six wiped at once, and the killed one back: trees of peers, nothing from the
        # trainer's link.
        wiped = replicas[2:]
        for r in wiped:
            r.agent.proc.stop()
        for r in wiped:
            shutil.rmtree(data / r.host.name)
        before = bed.tx_bytes(bed.trainer)
        for r in [victim, *wiped]:
            bed.restart(launcher, r.agent, wait=False)
        bed.wait_ready(launcher, *(r.agent for r in [victim, *wiped]))
        wait_until(
            lambda: all(_held(bed, r, token, 2, second["digest"]) for r in replicas),
            timeout=300,
            message="every replica caught up on v2",
        )
        egress = bed.tx_bytes(bed.trainer) - before
        with bed.inside(bed.trainer):
            metrics = httpx.get(router.url + "/metrics", timeout=10).text
        trees = sum(
            float(x.split()[-1])
            for x in metrics.splitlines()
            if x.startswith("lorafleet_router_catch_up_trees_total")
        )
        assert trees >= 1, trees
        # The router's calls and probes cross the trainer's link; no adapter copy does.
        assert egress < 0.25 * sizes[1], egress / sizes[1]


def first_config_size(adapters: list[Path]) -> int:
    """The config file both adapters share: deduplicated on the agents the second time."""
    a, b = (AdapterBundle.from_dir(x, name="x") for x in adapters)
    ca, cb = a.manifest.file("adapter_config.json"), b.manifest.file("adapter_config.json")
    return ca.size if ca == cb else 0
