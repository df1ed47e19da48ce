"""Registration by reference and watched directories (docs/placement.md), on reference engines.

Two replicas with 2 adapter slots each (4 in the fleet). Adapters are registered by directory:
the router reads each once (manifest and digest) and nothing is loaded anywhere until a request
places it. A skewed mix over more names than slots, with new names arriving in the watched
directory while it runs, is answered 200 for every request, tagged with its own adapter and
version, with the output the adapter gives when loaded directly into an engine of its own.
Changed bytes are refused by the agent that copies them, a path outside the router's roots or a
directory that is not an adapter is refused before anything is written, and a data-plane copy
resolves a watched name through the control plane.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lorafleet.launch import Launcher
from lorafleet.publisher import Publisher
from lorafleet.testing import (
    make_peft_adapter,
    start_dataplane,
    start_reference_engine,
    wait_until,
)
from tests.fleets import Fleet

pytestmark = pytest.mark.timeout(600)

SLOTS = 2
PROMPT = "The capital of"
REGISTERED = [f"reg-{i}" for i in range(6)]
WATCHED = [f"model-a_ckpt-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    d = {"src": root / "src", "watch": root / "watch", "made": root / "made", "out": root / "out"}
    for p in d.values():
        p.mkdir()
    return d


@pytest.fixture(scope="module")
def made(tiny_model, dirs) -> dict[str, Path]:
    """Every adapter the module uses, written once (outside any watched directory)."""
    return {
        name: make_peft_adapter(tiny_model, dirs["made"] / name, r=8, seed=300 + i)
        for i, name in enumerate([*REGISTERED, *WATCHED, "changed", "late"])
    }


@pytest.fixture(scope="module")
def expected(tiny_model, made, tmp_path_factory) -> dict[str, str]:
    """What each adapter answers when loaded directly into an engine of its own."""
    with Launcher(tmp_path_factory.mktemp("direct-logs")) as launcher:
        engine = start_reference_engine(launcher, tiny_model, max_loras=len(made))
        out = {}
        for name, path in made.items():
            r = httpx.post(
                engine.url + "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(path)},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            r = httpx.post(
                engine.url + "/v1/completions",
                json={"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                timeout=60,
            )
            out[name] = r.json()["choices"][0]["text"]
    assert len(set(out.values())) > len(out) // 2, "the adapters should answer differently"
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_fleet, dirs) -> Iterator[Fleet]:
    with Launcher(tmp_path_factory.mktemp("registration-logs")) as launcher:
        fleet = make_fleet(launcher, 2, max_loras=SLOTS, shared=dirs["src"].parent, router=False)
        fleet.router = fleet.start_router(
            state_dir=tmp_path_factory.mktemp("router-state"),
            extra=(
                "--watch-dir",
                str(dirs["watch"]),
                "--source-allow",
                str(dirs["src"]),
                "--cold-wait",
                "20",
            ),
        )
        yield fleet


def _register(fleet: Fleet, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(
        fleet.router.url + "/v1/control/registrations",
        json={"name": name, "path": str(path)},
        headers={"Authorization": f"Bearer {fleet.token}"},
        timeout=120,
    )


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )


def _drop_into(watch: Path, src: Path, name: str) -> None:
    """Put an adapter directory into the watched one as SkyRL does: written aside, renamed in."""
    tmp = watch / f".{name}.partial"
    shutil.copytree(src, tmp)
    os.rename(tmp, watch / name)


def test_registered_names_load_only_where_a_request_places_them(fleet, dirs, made, expected):
    for name in REGISTERED:
        shutil.copytree(made[name], dirs["src"] / name)
        r = _register(fleet, name, dirs["src"] / name)
        assert r.status_code == 201, r.text
        assert (r.json()["name"], r.json()["version"]) == (name, 1)
    # The same bytes again change nothing.
    again = _register(fleet, REGISTERED[0], dirs["src"] / REGISTERED[0])
    assert again.status_code == 200 and again.json()["created"] is False, again.text
    table = fleet.aliases()
    for name in REGISTERED:
        newest = table[name]["routable"][0]
        assert newest["replicas"] == [] and table[name]["placement"] == [], table[name]
    # Registered, not loaded: no agent holds a byte of them yet.
    for i in range(len(fleet.agents)):
        assert not [a for a in fleet.adapters(i) if a["name"] in REGISTERED]

    names = [*REGISTERED, *WATCHED]
    rng = random.Random(11)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(names))]
    mix = rng.choices(names, weights=weights, k=48)

    def ask(k: int) -> tuple[str, httpx.Response]:
        name = mix[k]
        if name in WATCHED and not (dirs["watch"] / name).exists():
            # Churn: the watched names arrive while the mix runs, each just before its first
            # request (no scan has seen it: the request itself has it registered).
            with lock:
                if not (dirs["watch"] / name).exists():
                    _drop_into(dirs["watch"], made[name], name)
        return name, _complete(fleet.router.url, name)

    lock = threading.Lock()
    with fleet.watch_slots(SLOTS) as over, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(len(mix))))
    for name, r in answers:
        assert r.status_code == 200, (name, r.status_code, r.text)
        tag = r.json()["lorafleet"]
        assert (tag["adapter"], tag["version"]) == (name, 1), tag
        assert r.json()["choices"][0]["text"] == expected[name], name
    assert not over, f"an engine held more than {SLOTS} adapters: {over[:3]}"
    assert fleet.staging_bytes() == [0] * len(fleet.agents)


def test_a_watched_directory_is_registered_by_its_scan(fleet, dirs, made, expected):
    _drop_into(dirs["watch"], made["late"], "late")
    wait_until(lambda: "late" in fleet.aliases(), timeout=30, message="the scan registers 'late'")
    assert fleet.aliases()["late"]["routable"][0]["replicas"] == []
    r = _complete(fleet.router.url, "late")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected["late"]


def test_a_data_plane_copy_resolves_a_watched_name(fleet, dirs, made, expected, tmp_path):
    with Launcher(tmp_path / "copy-logs") as launcher:
        copy = start_dataplane(launcher, fleet.router, token=fleet.token)
        name = "model-b_ckpt-0"
        _drop_into(dirs["watch"], made[WATCHED[0]], name)
        r = _complete(copy.url, name)
        assert r.status_code == 200, r.text
        assert r.json()["lorafleet"]["adapter"] == name
        assert r.json()["choices"][0]["text"] == expected[WATCHED[0]]
        missing = _complete(copy.url, "model-b_ckpt-404")
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"]["code"] == "not_found"


def test_bytes_changed_after_registration_are_refused_then_registered_anew(
    fleet, dirs, made, expected
):
    path = dirs["src"] / "changed"
    shutil.copytree(made["changed"], path)
    assert _register(fleet, "changed", path).status_code == 201
    # Someone rewrites the weights after registration: the copy is refused, nothing served.
    shutil.copy(made[REGISTERED[1]] / "adapter_model.safetensors", path)
    r = httpx.post(
        fleet.router.url + "/v1/control/aliases/changed/warm",
        json={},
        headers={"Authorization": f"Bearer {fleet.token}"},
        timeout=120,
    )
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "adapter_cold"
    assert fleet.staging_bytes() == [0] * len(fleet.agents)
    for i in range(len(fleet.agents)):
        assert not [a for a in fleet.adapters(i, "changed") if a["state"] != "failed"]
    # Registered again, the new bytes are the name's next version, and it serves.
    again = _register(fleet, "changed", path)
    assert again.status_code == 201 and again.json()["version"] == 2, again.text
    r = _complete(fleet.router.url, "changed")
    assert r.status_code == 200, r.text
    assert r.json()["lorafleet"]["version"] == 2
    assert r.json()["choices"][0]["text"] == expected[REGISTERED[1]]


@pytest.mark.parametrize(
    ("where", "status", "code"),
    [
        ("outside", 403, "path_not_allowed"),
        ("not_adapter", 422, "adapter_invalid"),
        ("missing", 422, "adapter_invalid"),
    ],
)
def test_a_bad_registration_is_refused_and_writes_nothing(
    fleet, dirs, tmp_path, where, status, code
):
    if where == "outside":
        path = tmp_path / "elsewhere"
        path.mkdir()
    elif where == "not_adapter":
        path = dirs["src"] / "not-an-adapter"
        path.mkdir(exist_ok=True)
        (path / "adapter_config.json").write_text("{}")
    else:
        path = dirs["src"] / "no-such-dir"
    before = fleet.aliases()
    r = _register(fleet, f"bad-{where.replace('_', '-')}", path)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert fleet.aliases() == before


def test_an_idle_on_demand_version_shrinks_back_to_zero(
    make_fleet, made, expected, tmp_path, tmp_path_factory
):
    """With ``--shrink-after 1``: a watched name loaded by a request is evicted again once idle
    (cold: its next request loads it again, from the agent's kept files); a published name's
    replicas are the publication's, never shrunk."""
    watch = tmp_path / "watch"
    watch.mkdir()
    with Launcher(tmp_path / "logs") as launcher:
        fleet = make_fleet(launcher, 2, max_loras=SLOTS, shared=tmp_path, router=False)
        fleet.router = fleet.start_router(
            state_dir=tmp_path_factory.mktemp("shrink-router"),
            extra=("--watch-dir", str(watch), "--shrink-after", "1"),
        )
        with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
            pub.publish(str(made[REGISTERED[2]]), name="published")
        _drop_into(watch, made[WATCHED[1]], "on-demand")
        r = _complete(fleet.router.url, "on-demand")
        assert r.status_code == 200, r.text

        def holders(name: str) -> list[str]:
            return fleet.aliases()[name]["routable"][0]["replicas"]

        assert len(holders("on-demand")) == 1
        wait_until(lambda: holders("on-demand") == [], timeout=60, message="idle shrink")
        metrics = httpx.get(fleet.router.url + "/metrics", timeout=10).text
        assert "lorafleet_router_idle_shrinks_total 1.0" in metrics
        assert len(holders("published")) == 2
        # Its files stay on the agent: loaded again on the next request.
        for i in range(len(fleet.agents)):
            assert not [a for a in fleet.adapters(i, "on-demand") if a["state"] != "staged"]
        r = _complete(fleet.router.url, "on-demand")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[WATCHED[1]]


def test_the_register_command(fleet, dirs, made):
    from click.testing import CliRunner

    from lorafleet.cli import main

    path = dirs["src"] / "by-cli"
    shutil.copytree(made[REGISTERED[3]], path)
    args = ["register", str(path), "--name", "by-cli", "--router", fleet.router.url]
    got = CliRunner().invoke(main, [*args, "--token", fleet.token])
    assert got.exit_code == 0, got.output
    assert got.output.startswith("by-cli v1 registered"), got.output
    assert fleet.aliases()["by-cli"]["routable"][0]["replicas"] == []
    again = CliRunner().invoke(main, [*args, "--token", fleet.token])
    assert "already registered" in again.output, again.output
    refused = CliRunner().invoke(main, [*args, "--token", "wrong"])
    assert refused.exit_code != 0 and "token" in refused.output.lower(), refused.output
