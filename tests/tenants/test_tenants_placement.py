"""Tenants on the placement paths (docs/tenants.md, docs/placement.md): registration by
reference with a tenant's token, and its quotas (adapters at registration, slots when its names
are loaded on demand), on 2 reference replicas with 2 slots each."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorafleet.launch import Launcher
from lorafleet.testing import make_peft_adapter
from tests.fleets import Fleet

pytestmark = pytest.mark.timeout(600)

ALICE, BOB = "alice-placement-token", "bob-placement-token"
TENANTS = f'''
[[tenant]]
id = "alice"
token = "{ALICE}"
names = ["alice-*"]
max_adapters = 3
max_slots = 2

[[tenant]]
id = "bob"
token = "{BOB}"
names = ["bob-*"]
'''


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_model) -> Path:
    root = tmp_path_factory.mktemp("tenant-sources")
    for i, name in enumerate(["alice-a", "alice-b", "alice-c", "alice-d", "bob-x"]):
        make_peft_adapter(tiny_model, root / name, r=8, seed=700 + i)
    return root


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_fleet, sources) -> Iterator[Fleet]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    with Launcher(tmp_path_factory.mktemp("tenant-placement-logs")) as launcher:
        fleet = make_fleet(launcher, 2, max_loras=2, shared=sources, router=False)
        fleet.router = fleet.start_router(
            state_dir=tmp_path_factory.mktemp("tenant-router"),
            extra=("--tenants", str(tenants), "--source-allow", str(sources)),
        )
        yield fleet


def _register(fleet: Fleet, token: str | None, name: str, path: Path) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(
        fleet.router.url + "/v1/control/registrations",
        json={"name": name, "path": str(path)},
        headers=headers,
        timeout=60,
    )


def _complete(fleet: Fleet, token: str, model: str) -> httpx.Response:
    return httpx.post(
        fleet.router.url + "/v1/completions",
        json={"model": model, "prompt": "The capital of", "max_tokens": 4, "temperature": 0},
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )


def test_a_tenant_registers_only_its_own_names(fleet, sources):
    before = fleet.aliases()
    # Another tenant's pattern, and a name nobody has: the same 404, nothing written.
    theirs = _register(fleet, ALICE, "bob-x", sources / "bob-x")
    nobody = _register(fleet, ALICE, "carol-x", sources / "bob-x")
    assert theirs.status_code == nobody.status_code == 404, (theirs.text, nobody.text)
    assert theirs.json()["error"]["code"] == nobody.json()["error"]["code"] == "not_found"
    assert _register(fleet, None, "alice-a", sources / "alice-a").status_code == 401
    assert _register(fleet, "wrong-token", "alice-a", sources / "alice-a").status_code == 403
    assert fleet.aliases() == before
    # Its own names, and the operator's registration of any name.
    assert _register(fleet, ALICE, "alice-a", sources / "alice-a").status_code == 201
    assert _register(fleet, BOB, "bob-x", sources / "bob-x").status_code == 201
    # A tenant's token opens no other control route.
    r = httpx.get(
        fleet.router.url + "/v1/control/aliases",
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=10,
    )
    assert r.status_code == 403


def test_the_adapters_quota_refuses_a_fourth_name_and_writes_nothing(fleet, sources):
    for name in ("alice-b", "alice-c"):
        r = _register(fleet, ALICE, name, sources / name)
        assert r.status_code in (200, 201), r.text
    before = fleet.aliases()
    r = _register(fleet, ALICE, "alice-d", sources / "alice-d")
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "tenant_quota_exceeded" and "max_adapters" in err["message"], err
    assert fleet.aliases() == before
    # The operator registering one of alice's names counts against her quota too.
    r = _register(fleet, fleet.token, "alice-d", sources / "alice-d")
    assert r.status_code == 409 and r.json()["error"]["code"] == "tenant_quota_exceeded"


def test_on_demand_loads_keep_a_tenant_within_its_slots(fleet, sources):
    """alice (max_slots 2) asks for her 3 names in turn: each cold one takes the slot of her
    own least recently used one; bob's loaded name is never evicted for her."""
    assert _complete(fleet, BOB, "bob-x").status_code == 200
    alice = ["alice-a", "alice-b", "alice-c"]
    held_over: list[dict] = []
    bob_gone: list[dict] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            table = fleet.aliases()
            slots = sum(len(v["replicas"]) for n in alice for v in table[n]["routable"])
            if slots > 2:
                held_over.append({n: table[n]["routable"] for n in alice})
            if not table["bob-x"]["routable"][0]["replicas"]:
                bob_gone.append(table["bob-x"])
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        answers = [(n, _complete(fleet, ALICE, n)) for n in alice * 3]
    finally:
        stop.set()
        watcher.join(10)
    for name, r in answers:
        assert r.status_code == 200, (name, r.text)
        assert r.json()["lorafleet"]["adapter"] == name
    assert not held_over, held_over[:2]
    assert not bob_gone, bob_gone[:1]
    # Her names answer as they did the first time they were loaded.
    first = {n: r.json()["choices"][0]["text"] for n, r in answers[:3]}
    assert all(r.json()["choices"][0]["text"] == first[n] for n, r in answers)


def test_a_tenant_cannot_make_the_data_plane_resolve_another_tenants_watched_name(fleet, sources):
    """A name outside alice's patterns is a plain 404 for her, before the control plane is
    asked about it (the table does not change)."""
    shutil.copytree(sources / "bob-x", sources / "bob-y", dirs_exist_ok=True)
    before = fleet.aliases()
    r = _complete(fleet, ALICE, "bob-y")
    assert r.status_code == 404
    assert fleet.aliases() == before
