"""``lorafleet.install.ReplicaInstall`` against real agents in front of reference engines.

The one install path publications and catch-up share: pushed and peer-relayed staging, load,
prove, activate; a peer that cannot send leaves no session or staging behind; the install's own
checks (other bytes proved) and bounds (a step past its limit) raise, and what the agent holds
afterwards is what the caller's rollback starts from.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from lorafleet.bundle import AdapterBundle
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.errors import InstallFailed, LorafleetError, ServiceError
from lorafleet.install import InstallTimeouts, ReplicaInstall
from lorafleet.launch import Launcher
from lorafleet.testing import make_peft_adapter, start_agent, start_reference_engine, wait_until
from tests.fleets import Fleet, FleetFactory

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_fleet: FleetFactory) -> Iterator[Fleet]:
    with Launcher(tmp_path_factory.mktemp("install-logs")) as launcher:
        yield make_fleet(launcher, 2, router=False)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("install-adapters")
    return {
        "a": make_peft_adapter(tiny_model, root / "a", r=8, seed=41),
        "b": make_peft_adapter(tiny_model, root / "b", r=8, seed=42),
        # over the reference engine's max LoRA rank (64)
        "huge": make_peft_adapter(tiny_model, root / "huge", r=128, seed=43),
    }


def _client(fleet: Fleet, i: int) -> AsyncAgentClient:
    return AsyncAgentClient(fleet.agent_urls[i], fleet.token)


async def _push(install: ReplicaInstall, bundle: AdapterBundle) -> None:
    """Stage ``bundle`` as a publication does: open, send what the agent lacks, commit."""
    session = await install.open()
    for path in session.missing:
        await install.send(bundle.manifest.file(path), bundle.source(path))
    await install.commit()


def _held(fleet: Fleet, i: int, name: str) -> list[tuple[int, str]]:
    return [(a["version"], a["state"]) for a in fleet.adapters(i) if a["name"] == name]


def test_a_pushed_install_loads_proves_and_activates(fleet, adapters):
    bundle = AdapterBundle.from_dir(adapters["a"], name="inst-ok", version=1)

    async def go():
        async with _client(fleet, 0) as client:
            install = ReplicaInstall(client, bundle.name, 1, bundle.manifest)
            await _push(install, bundle)
            assert install.upload_id is None  # committed: the agent closed the session
            await install.load()
            rec = await install.prove()
            await install.activate()
            return install, rec

    install, rec = asyncio.run(go())
    assert install.touched and install.load_attempted
    assert rec.digest == bundle.digest and rec.application != "unchecked"
    assert _held(fleet, 0, "inst-ok") == [(1, "active")]
    assert "inst-ok@v1" in fleet.engine_models(0)
    assert fleet.staging_bytes()[0] == 0


def test_an_install_from_a_peer_holds_the_peers_bytes(fleet, adapters):
    bundle = AdapterBundle.from_dir(adapters["b"], name="inst-peer", version=1)

    async def go():
        async with _client(fleet, 0) as source, _client(fleet, 1) as target:
            await _push(ReplicaInstall(source, bundle.name, 1, bundle.manifest), bundle)
            await source.load(bundle.name, 1)  # a peer sends what it serves
            install = ReplicaInstall(target, bundle.name, 1, bundle.manifest)
            await install.from_peer(source, fleet.agent_urls[1])
            await install.load()
            return await install.prove()

    rec = asyncio.run(go())
    assert rec.digest == bundle.digest
    assert "inst-peer@v1" in fleet.engine_models(1)
    assert fleet.staging_bytes() == [0, 0]


def test_a_peer_that_cannot_send_leaves_no_session_or_staging(fleet, adapters):
    bundle = AdapterBundle.from_dir(adapters["a"], name="inst-nopeer", version=1)

    async def go():
        # agent 0 never held inst-nopeer: the send it is asked for fails.
        async with _client(fleet, 0) as source, _client(fleet, 1) as target:
            install = ReplicaInstall(target, bundle.name, 1, bundle.manifest)
            with pytest.raises((InstallFailed, LorafleetError)) as caught:
                await install.from_peer(source, fleet.agent_urls[1])
            return install, caught.value

    install, _ = asyncio.run(go())
    assert install.upload_id is None  # discarded
    assert _held(fleet, 1, "inst-nopeer") == []
    assert fleet.staging_bytes()[1] == 0


def test_proving_other_bytes_than_the_installs_is_refused(fleet, adapters):
    """The agent holds v1 with bundle a's bytes; an install of v1 expecting b's bytes fails
    its proof rather than listing the replica for bytes it does not serve."""
    a = AdapterBundle.from_dir(adapters["a"], name="inst-other", version=1)
    b = AdapterBundle.from_dir(adapters["b"], name="inst-other", version=1)

    async def go():
        async with _client(fleet, 0) as client:
            first = ReplicaInstall(client, a.name, 1, a.manifest)
            await _push(first, a)
            await first.load()
            expecting_b = ReplicaInstall(client, b.name, 1, b.manifest)
            with pytest.raises(InstallFailed) as caught:
                await expecting_b.prove()
            return caught.value

    refused = asyncio.run(go())
    assert "proved other bytes" in str(refused) and a.digest[:12] in str(refused)


def test_an_engine_refused_load_raises_the_agents_error(launcher, tiny_model, adapters, tmp_path):
    # An agent told a higher rank limit than its engine's stages the adapter; the engine's
    # load refuses it, and the agent says so.
    engine = start_reference_engine(launcher, tiny_model, max_lora_rank=64)
    agent = start_agent(launcher, engine, tmp_path / "agent", max_lora_rank=256)
    bundle = AdapterBundle.from_dir(adapters["huge"], name="inst-huge", version=1)

    async def go():
        async with AsyncAgentClient(agent.url, agent.spec.token) as client:
            install = ReplicaInstall(client, bundle.name, 1, bundle.manifest)
            await _push(install, bundle)
            with pytest.raises(ServiceError) as caught:
                await install.load()
            assert install.load_attempted
            # What a caller's rollback does next: unload the record; nothing stays.
            await client.unload(bundle.name, 1)
            return caught.value, await client.list_adapters()

    refused, held = asyncio.run(go())
    assert refused.status == 502, refused
    assert held == []


def test_a_step_past_its_bound_raises_timeout(fleet, adapters):
    bundle = AdapterBundle.from_dir(adapters["a"], name="inst-slow", version=1)
    engine = fleet.engines[1]

    async def go():
        async with _client(fleet, 1) as client:
            install = ReplicaInstall(
                client, bundle.name, 1, bundle.manifest, InstallTimeouts(load_s=1.0)
            )
            await _push(install, bundle)
            await install.load()
            engine.proc.signal(signal.SIGSTOP)  # the probe's generation cannot answer
            try:
                with pytest.raises(TimeoutError):
                    await install.prove()
            finally:
                engine.proc.signal(signal.SIGCONT)
            # The agent's probe outlives ours; once it has answered, the version unloads
            # cleanly (blocking this loop is fine: nothing else runs on it meanwhile).
            wait_until(
                lambda: any(
                    a["name"] == "inst-slow" and a["application"] != "unchecked"
                    for a in fleet.adapters(1)
                ),
                message="the agent finishes the probe it was asked for",
            )
            await client.unload(bundle.name, 1)

    asyncio.run(go())
    assert _held(fleet, 1, "inst-slow") == []
    assert "inst-slow@v1" not in fleet.engine_models(1)
