"""The trainer's canary judged on every replica before the flip (reference engines).

A correct adapter passes, with its figures kept in the result and on the agent's record. Then
what reaches the engines differs from the model the trainer computed the canary with, as an
export bug would make it: ``lora_alpha`` changed in the config, the MLP tensors dropped, the rank
truncated, the base model's weights (B = 0) served as the adapter. Each is refused before the
flip, by name and with the figures, and v1 keeps serving.
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorafleet.errors import PublishError
from lorafleet.launch import Launcher
from lorafleet.protocol.canary import Canary
from lorafleet.publisher import Publisher
from lorafleet.publisher.canary import canary_from_dir, compute_canary
from lorafleet.publisher.result import Timeouts
from lorafleet.testing import ALL_LINEAR, make_peft_model, wait_until
from tests.fleets import Fleet
from tests.publisher.canary_faults import CONFIG, FAULTS

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_fleet) -> Iterator[Fleet]:
    with Launcher(tmp_path_factory.mktemp("canary-logs")) as launcher:
        yield make_fleet(launcher, 2)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> tuple[Path, Canary]:
    """The trainer's adapter (every linear projection, rank 16) and its canary."""
    model = make_peft_model(tiny_model, r=16, lora_alpha=16, seed=5, target_modules=ALL_LINEAR)
    canary = compute_canary(model, n=4)
    out = tmp_path_factory.mktemp("trained") / "adapter"
    model.save_pretrained(str(out))
    return out, canary


def _publish(fleet: Fleet, source: Path, name: str, canary: Canary):
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        return pub.publish(str(source), name=name, canary=canary)


def _entry(fleet: Fleet, name: str) -> dict:
    return fleet.aliases().get(name) or {}


def _served_version(fleet: Fleet, name: str) -> int:
    r = httpx.post(
        fleet.router.url + "/v1/completions",
        json={"model": name, "prompt": "hi", "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["lorafleet"]["version"]


def test_a_correct_adapter_passes_and_its_figures_are_kept(fleet, trained, tiny_model):
    adapter, canary = trained
    result = _publish(fleet, adapter, "canary-ok", canary)
    for rep in result.replicas.values():
        assert rep.canary is not None and rep.canary.outcome == "passed", rep.canary
        assert rep.canary.mean_vs_trainer <= 0.25 * rep.canary.mean_vs_base
        print(f"reference canary {rep.replica}: {rep.canary.detail}")
    for i in range(len(fleet.agents)):
        (rec,) = fleet.adapters(i, "canary-ok")
        assert rec["canary"]["outcome"] == "passed"
    # The router's table keeps each replica's figures for the version, and /metrics shows them.
    (v1,) = _entry(fleet, "canary-ok")["routable"]
    assert set(v1["canary"]) == set(v1["replicas"]) == set(result.replicas)
    for rid, judged in v1["canary"].items():
        assert judged == result.replicas[rid].canary.model_dump()
    metrics = httpx.get(fleet.router.url + "/metrics", timeout=10).text
    for rid, judged in v1["canary"].items():
        labels = f'adapter="canary-ok",replica="{rid}",version="1"'
        assert f"lorafleet_router_canary_passed{{{labels}}} 1.0" in metrics
        line = 'lorafleet_router_canary_delta{adapter="canary-ok",against="trainer",'
        line += f'replica="{rid}",stat="mean",version="1"}} '
        (value,) = [x for x in metrics.splitlines() if x.startswith(line)]
        assert float(value.split()[-1]) == pytest.approx(judged["mean_vs_trainer"])
    # The canary from the directory on CPU (``--canary-model``) is the in-memory one.
    again = canary_from_dir(tiny_model, adapter, prompts=[p.prompt_ids for p in canary.prompts])
    for a, b in zip(again.prompts, canary.prompts, strict=True):
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.trainer, b.trainer, strict=True)) < 1e-4


@pytest.mark.parametrize("fault", list(FAULTS))
def test_what_the_trainer_did_not_compute_is_refused_before_the_flip(
    fleet, trained, tmp_path, fault: str
):
    adapter, canary = trained
    name = f"canary-{fault.replace('_', '-')}"
    _publish(fleet, adapter, name, canary)
    broken = tmp_path / "broken"
    shutil.copytree(adapter, broken)
    FAULTS[fault](broken)
    with pytest.raises(PublishError) as err:
        _publish(fleet, broken, name, canary)
    reasons = list(err.value.failures.values())
    assert len(reasons) == len(fleet.agents), err.value.failures
    assert all("canary" in r and "against the trainer" in r for r in reasons), reasons
    print(f"reference canary, {name}: {reasons[0]}")
    assert "v1 keeps serving" in str(err.value)
    assert _served_version(fleet, name) == 1
    for i in range(len(fleet.agents)):
        assert {a["version"] for a in fleet.adapters(i, name)} == {1}


def test_a_replica_caught_up_from_a_peer_is_proven_by_the_same_canary(fleet, trained):
    """A quorum publication leaves replica 1 lagging (its agent stopped); the router's catch-up
    feeds it from replica 0 and proves its copy with the canary replica 0 was proven with."""
    adapter, canary = trained
    name = "canary-catch-up"
    fleet.agents[1].proc.signal(signal.SIGSTOP)
    try:
        with Publisher(
            fleet.agent_urls, router=fleet.router.url, token=fleet.token,
            timeouts=Timeouts(answer=3.0),
        ) as pub:  # fmt: skip
            result = pub.publish(str(adapter), name=name, canary=canary, min_replicas=1)
        assert len(result.lagging) == 1
    finally:
        fleet.agents[1].proc.signal(signal.SIGCONT)
    wait_until(
        lambda: fleet.adapters(1, name), timeout=120, message="replica 1 caught up from its peer"
    )
    wait_until(
        lambda: fleet.adapters(1, name)[0]["canary"] is not None,
        timeout=120,
        message="its copy proven by the canary",
    )
    (record,) = fleet.adapters(1, name)
    assert record["canary"]["outcome"] == "passed", record
    assert record["canary"]["mean_vs_trainer"] < 1e-3
    # The router lists it with the figures its catch-up was judged by.
    replica1 = fleet.agents[1].url.removeprefix("http://")
    (v1,) = wait_until(
        lambda: replica1 in _holders(fleet, name, 1) and _entry(fleet, name)["routable"],
        timeout=60,
        message="replica 1 listed for v1",
    )
    assert v1["canary"][replica1] == record["canary"]


def _holders(fleet: Fleet, name: str, version: int) -> set[str]:
    e = _entry(fleet, name)
    return {x for v in e.get("routable", []) if v["version"] == version for x in v["replicas"]}


def _canary_checks(fleet: Fleet, i: int, outcome: str) -> float:
    text = httpx.get(fleet.agents[i].url + "/metrics", timeout=10).text
    key = f'lorafleet_agent_canary_checks_total{{outcome="{outcome}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(key)), 0.0)


def test_a_reinstall_after_an_engine_restart_is_proven_by_the_canary(fleet, trained):
    """Replica 0's engine restarts; its agent reinstalls v1 from its store, where the config
    was changed meanwhile (lora_alpha x4). The reinstall fails the canary it was published
    with, and the router stops routing v1 there."""
    adapter, canary = trained
    name = "canary-reinstall"
    _publish(fleet, adapter, name, canary)
    replica0 = fleet.agents[0].url.removeprefix("http://")
    assert replica0 in _holders(fleet, name, 1)
    failed_before = _canary_checks(fleet, 0, "failed")
    (record,) = fleet.adapters(0, name)
    config = Path(record["path"]) / CONFIG
    cfg = json.loads(config.read_text())
    cfg["lora_alpha"] *= 4
    changed = config.with_suffix(".tmp")
    changed.write_text(json.dumps(cfg))
    changed.replace(config)  # a new file: the store's other links keep their bytes
    fleet.launcher.restart(fleet.engines[0])
    wait_until(
        lambda: _canary_checks(fleet, 0, "failed") > failed_before,
        timeout=120,
        message="the reinstalled version judged by its canary",
    )
    wait_until(
        lambda: replica0 not in _holders(fleet, name, 1),
        timeout=60,
        message="the router stops routing v1 to replica 0",
    )
