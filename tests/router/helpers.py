"""Router test helpers: install adapters on agents, set aliases, wait for health."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from aiohttp import web

from lorafleet.agent.spec import AgentSpec
from lorafleet.launch import Server
from lorafleet.router.spec import RouterSpec
from lorafleet.testing import wait_until


def ctl(router: Server[RouterSpec]) -> dict[str, str]:
    """The router's control-token header."""
    return {"Authorization": f"Bearer {router.spec.token}"}


def wait_healthy(router: Server[RouterSpec], n: int, timeout: float = 30.0) -> list[dict]:
    """Wait until ``n`` replicas are in rotation; the replica list."""
    reps: list[dict] = []

    def healthy() -> bool:
        nonlocal reps
        r = httpx.get(router.url + "/v1/control/replicas", headers=ctl(router), timeout=5)
        reps = r.json()["replicas"]
        return sum(1 for x in reps if x["healthy"]) == n

    wait_until(healthy, timeout=timeout, message=f"{n} healthy replicas")
    return reps


async def install(agent: Server[AgentSpec], peft_dir: Path, name: str, version: int) -> str:
    """Upload + commit + load ``name`` v``version`` on one agent; the engine-side name."""
    from lorafleet.bundle.bundle import AdapterBundle
    from lorafleet.clients.agent import AsyncAgentClient

    bundle = AdapterBundle.from_dir(peft_dir, name=name, version=version)
    async with AsyncAgentClient(agent.url, agent.spec.token) as c:
        sess = await c.open_upload(bundle.manifest)
        for entry in bundle.files:
            if entry.path in sess.missing:
                await c.upload_file(sess.upload_id, entry, bundle.source(entry.path))
        await c.commit(sess.upload_id)
        rec = await c.load(name, version)
    return rec.engine_name


def install_sync(agents: list[Server[AgentSpec]], peft_dir: Path, name: str, version: int) -> str:
    async def go() -> list[str]:
        return await asyncio.gather(*(install(a, peft_dir, name, version) for a in agents))

    names = asyncio.run(go())
    assert len(set(names)) == 1, names
    return names[0]


def set_alias(
    router: Server[RouterSpec],
    name: str,
    version: int,
    engine_name: str,
    replicas: list[str],
    **extra,
) -> httpx.Response:
    body = {"version": version, "engine_name": engine_name, "replicas": replicas, **extra}
    return httpx.put(
        f"{router.url}/v1/control/aliases/{name}", json=body, headers=ctl(router), timeout=10
    )


async def serve_completions(handler) -> tuple[web.AppRunner, str]:
    """A stand-in engine on loopback answering POST /v1/completions with ``handler``; the runner
    (``await runner.cleanup()`` stops it) and its URL."""
    return await serve_route("POST", "/v1/completions", handler)


async def serve_route(method: str, path: str, handler) -> tuple[web.AppRunner, str]:
    """A stand-in server on loopback answering ``method path`` with ``handler``; the runner
    (``await runner.cleanup()`` stops it) and its URL."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
