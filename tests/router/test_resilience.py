"""Traffic shaped like RL: bursts with idle gaps, slow probes, stalled agents.

Engines (uvicorn: the reference engine, vLLM, SGLang) close idle keep-alive connections after
5 s. A request that meets such a connection must be sent again on a fresh one, not count as a
dead replica; one slow health probe must not take a replica out; and when every replica of a
version looks unhealthy the router tries them rather than answering 503 untried.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import httpx
import pytest

from lorafleet._http import REPLAYABLE, async_client
from lorafleet.dataplane.balancer import Balancer
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.pipeline import Pipeline
from lorafleet.router.table import AliasStore
from lorafleet.testing import start_agent, start_router, wait_until
from tests.router.helpers import ctl, install_sync, set_alias, wait_healthy

pytestmark = pytest.mark.timeout(600)


class DropsReusedConnections:
    """An HTTP/1.1 server that answers the first request on each connection (keep-alive) and
    closes the connection without answering any later one: exactly what a client meets when the
    server closed an idle connection just as the client reused it."""

    def __init__(self, body: dict) -> None:
        self.body = json.dumps(body).encode()
        self.answered = 0
        self.dropped = 0

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if served:
                    self.dropped += 1
                    return  # closed without an answer
                served += 1
                self.answered += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(self.body)}\r\n\r\n".encode()
                    + self.body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_httpx_clients_resend_once_on_a_connection_closed_under_them():
    async def scenario() -> None:
        async with DropsReusedConnections({"ok": True}) as url:
            async with httpx.AsyncClient() as plain:
                assert (await plain.get(url)).status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):
                    await plain.get(url)  # the failure lorafleet's clients must absorb
            async with async_client() as ours:
                for _ in range(3):
                    assert (await ours.get(url)).status_code == 200
                    r = await ours.post(url, json={"x": 1}, extensions=REPLAYABLE)
                    assert r.status_code == 200
            async with async_client() as ours:
                # A POST that may have acted is not sent twice: the caller must find out.
                assert (await ours.post(url, json={"x": 1})).status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):
                    await ours.post(url, json={"x": 1})

    asyncio.run(scenario())


async def _proxy_call(proxy: Pipeline, body: dict) -> tuple[int, dict]:
    """Drive the bare-ASGI proxy in-process; (status, JSON body)."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await proxy(scope, receive, send)
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(payload)


def test_router_resends_on_a_fresh_connection_and_keeps_the_replica():
    """Before: the reused connection's failure marked the only replica dead (503 for everyone
    until the next health poll)."""
    answer = {"id": "c", "model": "p@v1", "choices": [{"index": 0, "text": "x"}]}

    async def scenario() -> None:
        store = AliasStore()
        store.set_alias("p", 1, "p@v1", ["r0"])
        balancer = Balancer(["http://agent"])
        server = DropsReusedConnections(answer)
        async with (
            server as url,
            aiohttp.ClientSession() as pooled,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh,
        ):
            rep = balancer.replicas[0]
            rep.replica_id, rep.engine_url, rep.healthy = "r0", url, True
            balancer.reindex()
            proxy = Pipeline(store, balancer, RouterMetrics(), pooled, fresh=fresh)
            # new connection, reused (dropped: resent fresh), new, reused (dropped: resent fresh)
            for _ in range(4):
                status, body = await _proxy_call(proxy, {"model": "p", "prompt": "hi"})
                assert status == 200, body
                assert body["lorafleet"]["version"] == 1
            assert rep.healthy and rep.failures == 0
            assert server.dropped == 2
            assert proxy.metrics.stale_retries._value.get() == 2
            assert proxy.metrics.retries._value.get() == 0  # no failover: the replica was fine

    asyncio.run(scenario())


def _bursts(router_url: str, model: str, *, bursts: int, size: int, gaps: list[float]) -> list:
    """``bursts`` bursts of ``size`` concurrent completions, separated by idle ``gaps``."""

    async def run() -> list:
        out = []
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(bursts):
                if i:
                    await asyncio.sleep(gaps[(i - 1) % len(gaps)])
                body = {"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0}
                rs = await asyncio.gather(
                    *(client.post(router_url + "/v1/completions", json=body) for _ in range(size))
                )
                out += [(r.status_code, r.text[:200]) for r in rs]
        return out

    return asyncio.run(run())


# Idle gaps around the engines' 5 s keep-alive, where a pooled connection dies under a request.
EDGE_GAPS = [4.9, 4.95, 5.0, 4.85, 5.05]


def test_bursts_across_the_keepalive_edge_never_fail(launcher, fleet, peft_dir):
    a, b = fleet.replicas
    en = install_sync([a.agent, b.agent], peft_dir, "bursty", 1)
    r = fleet.start_router(launcher)
    wait_healthy(r, 2)
    assert set_alias(r, "bursty", 1, en, [a.replica_id, b.replica_id]).status_code == 200
    results = _bursts(r.url, "bursty", bursts=7, size=30, gaps=EDGE_GAPS)
    failed = [x for x in results if x[0] != 200]
    assert len(results) == 210 and failed == [], failed[:5]
    reps = httpx.get(r.url + "/v1/control/replicas", headers=ctl(r)).json()["replicas"]
    assert all(x["healthy"] for x in reps), reps


def test_a_stalled_agent_neither_drops_its_replica_nor_fails_requests(launcher, fleet, peft_dir):
    """One replica whose agent stops answering probes (SIGSTOP; its engine still serves).

    Short stall: fewer failed probes than the threshold, the replica stays in rotation. Long
    stall: it leaves rotation, and with no healthy replica left for the version the router
    still tries it (panic) instead of answering 503 untried.
    """
    a, _ = fleet.replicas
    en = install_sync([a.agent], peft_dir, "stall", 1)
    r = start_router(
        launcher,
        [a.agent],
        token=fleet.token,
        health_interval=fleet.health_interval,
        extra=["--health-timeout", "0.3", "--unhealthy-after", "4", "--healthy-after", "2"],
    )
    wait_healthy(r, 1)
    assert set_alias(r, "stall", 1, en, [a.replica_id]).status_code == 200

    def replica() -> dict:
        return httpx.get(r.url + "/v1/control/replicas", headers=ctl(r)).json()["replicas"][0]

    def complete() -> int:
        body = {"model": "stall", "prompt": "hi", "max_tokens": 2, "temperature": 0}
        return httpx.post(r.url + "/v1/completions", json=body, timeout=30).status_code

    a.agent.proc.signal(signal.SIGSTOP)
    try:
        # The short stall itself (not a wait for a condition): one or two probes time out,
        # fewer than --unhealthy-after.
        time.sleep(0.45)
        assert replica()["healthy"] is True
        assert complete() == 200
        wait_until(lambda: replica()["healthy"] is False, message="the long stall leaves rotation")
        assert [complete() for _ in range(3)] == [200, 200, 200]
    finally:
        a.agent.proc.signal(signal.SIGCONT)
    metrics = httpx.get(r.url + "/metrics").text
    assert "lorafleet_router_panic_routed_total 3.0" in metrics
    wait_healthy(r, 1)


@pytest.mark.vllm
def test_bursts_across_the_keepalive_edge_on_real_vllm(vllm_server, launcher, peft_dir, tmp_path):
    agent = start_agent(
        launcher, vllm_server, tmp_path / "agent", kind="vllm", replica_id="v0", timeout=120
    )
    r = start_router(launcher, [agent], token=agent.spec.token)
    wait_healthy(r, 1, timeout=60)
    en = install_sync([agent], peft_dir, "vbursty", 1)
    try:
        assert set_alias(r, "vbursty", 1, en, ["v0"]).status_code == 200
        results = _bursts(r.url, "vbursty", bursts=6, size=8, gaps=EDGE_GAPS)
        failed = [x for x in results if x[0] != 200]
        assert len(results) == 48 and failed == [], failed[:5]
    finally:
        httpx.post(
            f"{agent.url}/v1/adapters/unload",
            json={"name": "vbursty", "version": 1},
            headers={"Authorization": f"Bearer {agent.spec.token}"},
            timeout=60,
        )
