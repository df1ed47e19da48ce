"""The front with tenants: a tenant's token is a trainer token for its own names, within its
quotas; another tenant's name is refused as an unknown adapter before any byte moves."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafleet.front.service import HANDOVER_DIR, Front, FrontConfig
from lorafleet.launch import Launcher
from lorafleet.protocol.manifest import ALLOWED_FILES
from lorafleet.protocol.tenants import OPERATOR, Caller, Tenants
from tests.fleets import Fleet
from tests.front.conftest import FrontServers
from tests.tenants.conftest import bearer

ALICE, BOB, TRAINER = "alice-token", "bob-token", "trainer-token"


@dataclass
class FrontFleet:
    url: str
    fleet: Fleet
    shared: Path
    adapter: Path
    size: int

    def load(self, name: str, token: str | None) -> httpx.Response:
        body = {"lora_name": name, "lora_path": str(self.adapter)}
        return httpx.post(
            self.url + "/v1/load_lora_adapter", json=body, headers=bearer(token), timeout=120
        )

    def unload(self, name: str, token: str | None) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/unload_lora_adapter",
            json={"lora_name": name},
            headers=bearer(token),
            timeout=60,
        )

    def complete(self, model: str, token: str | None) -> httpx.Response:
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        return httpx.post(
            self.url + "/v1/completions", json=body, headers=bearer(token), timeout=60
        )

    def names_everywhere(self) -> set[str]:
        """Every adapter name an agent holds or the router routes."""
        held = {a["name"] for i in range(len(self.fleet.agents)) for a in self.fleet.adapters(i)}
        return held | set(self.fleet.aliases())

    def handover_files(self) -> list[Path]:
        root = self.shared / HANDOVER_DIR
        return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.fixture(scope="module")
def front(make_fleet, adapter_dir, tmp_path_factory) -> Iterator[FrontFleet]:
    root = tmp_path_factory.mktemp("front-tenants")
    shared = root / "shared"
    adapter = shared / "adapter"
    shutil.copytree(adapter_dir, adapter)
    size = sum((adapter / f).stat().st_size for f in ALLOWED_FILES if (adapter / f).is_file())
    tenants = Tenants.parse(
        {
            "tenant": [
                {"id": "alice", "token": ALICE, "names": ["alice-*"], "max_adapters": 1},
                {"id": "bob", "token": BOB, "names": ["bob-*"], "max_bytes": size - 1},
            ]
        }
    )
    fronts = FrontServers()
    with Launcher(root / "logs") as launcher:
        fleet = make_fleet(launcher, 1, shared=shared)
        assert fleet.router is not None
        url = fronts.start(
            FrontConfig(
                agents=fleet.agent_urls,
                router=fleet.router.url,
                shared_dirs=[shared],
                fleet_token=fleet.token,
                trainer_token=TRAINER,
                tenants=tenants,
            )
        )
        try:
            yield FrontFleet(url, fleet, shared, adapter, size)
        finally:
            fronts.stop()


def test_a_tenant_loading_another_tenants_name_is_refused_before_any_byte_moves(front):
    unknown = front.unload("bob-never-loaded", ALICE)
    assert unknown.status_code == 404
    for name in ("bob-z", "bob-z-v3", "carol-q"):
        r = front.load(name, ALICE)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == unknown.json()["error"]["code"] == "adapter_not_found"
        assert r.json()["error"]["message"] == f"The lora adapter '{name}' cannot be found."
    assert "bob-z" not in front.names_everywhere()
    assert front.handover_files() == []
    # The operator's trainer token loads it; alice still cannot see, use or unload it.
    assert front.load("bob-z", TRAINER).status_code == 200
    missing = front.complete("alice-nothing", ALICE)
    refused = front.complete("bob-z", ALICE)
    assert missing.status_code == refused.status_code == 404
    assert refused.json()["error"]["code"] == missing.json()["error"]["code"]
    assert refused.json()["error"]["message"] == "The model `bob-z` does not exist."
    assert front.complete("bob-z", TRAINER).status_code == 200
    r = front.unload("bob-z-v1", ALICE)
    assert r.status_code == 404 and r.json()["error"]["message"] == (
        "The lora adapter 'bob-z-v1' cannot be found."
    )
    assert "bob-z" in front.fleet.aliases()


def test_a_tenant_loads_and_serves_its_own_names_within_max_adapters(front):
    r = front.load("alice-a", ALICE)
    assert r.status_code == 200, r.text
    assert front.load("alice-a", ALICE).status_code == 200, "a new version of the same name"
    r = front.complete("alice-a", ALICE)
    assert r.status_code == 200, r.text
    r = front.load("alice-b", ALICE)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "tenant_quota_exceeded" and err["param"] == "max_adapters"
    assert "limit is 1 adapter names" in err["message"] and "would make 2" in err["message"]
    assert "alice-b" not in front.names_everywhere()
    assert front.handover_files() == []


def test_a_load_past_max_bytes_is_refused_with_the_figures(front):
    # What bob's names hold already (bob-z, if the operator loaded it), from the router's table.
    held = sum(
        v["size"] or 0
        for name, e in front.fleet.aliases().items()
        if name.startswith("bob-")
        for v in e["routable"]
    )
    r = front.load("bob-big", BOB)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "tenant_quota_exceeded" and err["param"] == "max_bytes"
    assert f"limit is {front.size - 1} bytes" in err["message"]
    assert f"holds {held}, and this would make {held + front.size}" in err["message"]
    assert "bob-big" not in front.names_everywhere()
    assert front.handover_files() == []


def test_models_on_the_front_lists_the_tenants_own_names(front):
    def ids(token: str | None) -> set[str]:
        r = httpx.get(front.url + "/v1/models", headers=bearer(token), timeout=30)
        assert r.status_code == 200, r.text
        return {m["id"] for m in r.json()["data"][1:]}

    assert ids(ALICE) <= {"alice-a"} and "bob-z" not in ids(ALICE)
    assert "bob-z" in ids(TRAINER)
    assert httpx.get(front.url + "/v1/models", timeout=30).status_code == 401
    r = httpx.get(front.url + "/v1/models", headers=bearer("stranger"), timeout=30)
    assert r.status_code == 403


def test_each_tenant_stages_uploads_of_its_own():
    alice, bob = (
        Caller(t)
        for t in Tenants.parse(
            {
                "tenant": [
                    {"id": "alice", "token": ALICE, "names": ["alice-*"]},
                    {"id": "bob", "token": BOB, "names": ["bob-*"]},
                ]
            }
        )
    )
    uid = "0b0e8a1c-3f51-4a57-9d6c-2b9a2e0b7a11"
    assert Front.upload_key(OPERATOR, uid) == uid
    keys = {Front.upload_key(c, uid) for c in (alice, bob)}
    assert len(keys) == 2 and uid not in keys
