"""A fleet shared by the tenants tests: one reference engine behind one agent, a router with an
inference key and a tenants file (alice owns ``alice-*``, bob ``bob-*``), and one adapter
published for each tenant."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafleet.launch import Launcher, Server
from lorafleet.publisher import Publisher
from lorafleet.router.spec import RouterSpec
from lorafleet.testing import make_peft_adapter, wait_until
from tests.fleets import Fleet

ALICE = "alice-token"
BOB = "bob-token"
API_KEY = "operator-inference-key"
TENANTS_TOML = f'''
[[tenant]]
id = "alice"
token = "{ALICE}"
names = ["alice-*"]

[[tenant]]
id = "bob"
token_sha256 = "{hashlib.sha256(BOB.encode()).hexdigest()}"
names = ["bob-*"]
'''


def bearer(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


@dataclass
class TenantFleet:
    fleet: Fleet
    router: Server[RouterSpec]
    tenants_file: Path
    base_model: str

    @property
    def url(self) -> str:
        return self.router.url

    def engine_requests(self) -> float:
        """Generation requests every engine has answered (``lorafleet_engine_requests_total``;
        its ``/v1/models``, which agents probe, left out)."""
        total = 0.0
        for engine in self.fleet.engines:
            text = httpx.get(engine.url + "/metrics", timeout=10).text
            total += sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("lorafleet_engine_requests_total{")
                and 'route="/v1/models"' not in line
            )
        return total

    def table(self) -> dict[str, dict]:
        r = httpx.get(
            self.url + "/v1/control/aliases",
            params={"log": "false"},
            headers=bearer(self.fleet.token),
            timeout=10,
        )
        r.raise_for_status()
        return r.json()["aliases"]

    def stores(self) -> list[list[tuple[str, int, str]]]:
        """Each agent's adapters: (name, version, state)."""
        return [
            sorted((a["name"], a["version"], a["state"]) for a in self.fleet.adapters(i))
            for i in range(len(self.fleet.agents))
        ]


@pytest.fixture(scope="session")
def adapter_dir(tiny_model, tmp_path_factory) -> Path:
    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("peft") / "adapter", r=8, seed=3)


@pytest.fixture(scope="module")
def tenant_fleet(make_fleet, adapter_dir, tmp_path_factory) -> Iterator[TenantFleet]:
    root = tmp_path_factory.mktemp("tenants")
    tenants_file = root / "tenants.toml"
    tenants_file.write_text(TENANTS_TOML)
    with Launcher(root / "logs") as launcher:
        fleet = make_fleet(launcher, 1, router=False)
        router = fleet.start_router(
            api_key=API_KEY, state_dir=root / "router", extra=("--tenants", str(tenants_file))
        )
        fleet.router = router
        wait_until(
            lambda: httpx.get(router.url + "/v1/models", headers=bearer(API_KEY)).json()["data"],
            message="the router sees its replica's base model",
        )
        with Publisher(fleet.agent_urls, router=router.url, token=fleet.token) as pub:
            for name in ("alice-x", "bob-y"):
                assert pub.publish(str(adapter_dir), name=name).version == 1
        base = httpx.get(router.url + "/v1/models", headers=bearer(API_KEY)).json()["data"][0]
        yield TenantFleet(fleet, router, tenants_file, base["id"])
