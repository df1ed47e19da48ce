"""Test helpers: real engines + agents + routers on loopback, and adapter installation."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lorafleet._procs import free_port, lorafleet_argv
from lorafleet.testing import Procs, Server, start_agent, start_reference_engine  # noqa: F401

CONTROL = "ctl-" + secrets.token_hex(8)


@dataclass
class Router:
    url: str
    proc: object
    argv: list[str]
    token: str = CONTROL
    api_key: str | None = None
    state_dir: Path | None = None

    def ctl(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@dataclass
class Replica:
    replica_id: str
    engine: object
    agent: object
    installed: set[tuple[str, int]] = field(default_factory=set)


def start_router(
    procs,
    agents: list[str],
    *,
    state_dir: Path | None = None,
    api_key: str | None = None,
    extra: list[str] | None = None,
    port: int | None = None,
    agent_token: str | None = None,
) -> Router:
    port = port or free_port()
    argv = lorafleet_argv(
        "router",
        "--agents",
        ",".join(agents),
        "--port",
        str(port),
        "--control-token",
        CONTROL,
        "--health-interval",
        "0.2",
        *(["--agent-token", agent_token] if agent_token else []),
        *(["--state-dir", str(state_dir)] if state_dir else []),
        *(["--api-key", api_key] if api_key else []),
        *(extra or []),
    )
    url = f"http://127.0.0.1:{port}"
    proc = procs.start(argv, ready_url=url + "/health", name="router", timeout=30)
    return Router(url=url, proc=proc, argv=argv, api_key=api_key, state_dir=state_dir)


def wait_healthy(router: Router, n: int, timeout: float = 20.0) -> list[dict]:
    """Wait until ``n`` replicas are in rotation; the replica list."""
    import time

    deadline = time.monotonic() + timeout
    reps: list[dict] = []
    while time.monotonic() < deadline:
        r = httpx.get(router.url + "/v1/control/replicas", headers=router.ctl(), timeout=5)
        reps = r.json()["replicas"]
        if sum(1 for x in reps if x["healthy"]) == n:
            return reps
        time.sleep(0.1)
    raise TimeoutError(f"wanted {n} healthy replicas, have {reps}")


async def install(agent, peft_dir: Path, name: str, version: int) -> str:
    """Upload + commit + load ``name`` v``version`` on one agent; the engine-side name."""
    from lorafleet.agent.client import AsyncAgentClient
    from lorafleet.bundle.bundle import AdapterBundle

    bundle = AdapterBundle.from_dir(peft_dir, name=name, version=version)
    async with AsyncAgentClient(agent.url, agent.token) as c:
        sess = await c.open_upload(bundle.manifest)
        for entry in bundle.files:
            if entry.path in sess.missing:
                await c.upload_file(sess.upload_id, entry, bundle.source(entry.path))
        await c.commit(sess.upload_id)
        rec = await c.load(name, version)
    return rec.engine_name


async def uninstall(agent, name: str, version: int) -> None:
    from lorafleet.agent.client import AsyncAgentClient

    async with AsyncAgentClient(agent.url, agent.token) as c:
        await c.unload(name, version)


def install_sync(agents: list, peft_dir: Path, name: str, version: int) -> str:
    async def go() -> list[str]:
        return await asyncio.gather(*(install(a, peft_dir, name, version) for a in agents))

    names = asyncio.run(go())
    assert len(set(names)) == 1, names
    return names[0]


def set_alias(
    router: Router, name: str, version: int, engine_name: str, replicas: list[str], **extra
) -> httpx.Response:
    body = {"version": version, "engine_name": engine_name, "replicas": replicas, **extra}
    return httpx.put(
        f"{router.url}/v1/control/aliases/{name}", json=body, headers=router.ctl(), timeout=10
    )
