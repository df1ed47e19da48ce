"""``PUT /v1/control/replicas/{id}``: a re-placed replica is polled at its new agent URL and taken
off every version it held (durably), and bad moves are precise 4xx that change nothing.

End to end (a Ray node dies, its replica comes back elsewhere): tests/on_ray/test_node_loss.py.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lorafleet.router.app import RouterConfig, create_app
from lorafleet.router.table import AliasStore

TOKEN = "ctl-t0ken"
H = {"Authorization": f"Bearer {TOKEN}"}
OLD = ["http://127.0.0.1:9", "http://127.0.0.1:10"]


@pytest.fixture
def router(tmp_path):
    app = create_app(RouterConfig(agents=OLD, control_token=TOKEN, state_dir=str(tmp_path)))
    for i, r in enumerate(app.balancer.replicas):  # as if the agents had been polled
        r.replica_id, r.engine_url, r.healthy, r.probed = f"r{i}", f"http://e{i}", True, True
    app.balancer.reindex()
    client = TestClient(app.api, raise_server_exceptions=False)
    client.app_ = app  # type: ignore[attr-defined]
    return client


def _flip(router, name, version, replicas, keep=1):
    body = {
        "version": version,
        "engine_name": f"{name}@v{version}",
        "replicas": replicas,
        "keep_versions": keep,
    }
    r = router.put(f"/v1/control/aliases/{name}", json=body, headers=H)
    assert r.status_code == 200, r.text


def _holders(router):
    table = router.get("/v1/control/aliases", headers=H).json()["aliases"]
    return {(name, v["version"]): v["replicas"] for name, e in table.items() for v in e["routable"]}


def test_a_moved_replica_is_polled_at_its_new_url_and_holds_nothing(router, tmp_path):
    _flip(router, "a", 1, ["r0", "r1"])
    _flip(router, "a", 2, ["r0", "r1"], keep=2)
    _flip(router, "solo", 1, ["r1"])
    _flip(router, "other", 1, ["r0"])
    app = router.app_
    app.balancer.sessions.stick("s", app.balancer.replicas[1])

    r = router.put("/v1/control/replicas/r1", json={"agent_url": "http://127.0.0.1:11/"}, headers=H)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["replica_id"] == "r1" and got["agent_url"] == "http://127.0.0.1:11"
    assert got["healthy"] is False and got["engine_url"] is None  # relearned at the next poll
    moved = app.balancer.replicas[1]
    assert moved.agent_url == "http://127.0.0.1:11" and app.balancer.sessions.replica("s") is None
    assert _holders(router) == {
        ("a", 2): ["r0"],
        ("a", 1): ["r0"],
        ("solo", 1): [],  # its only holder moved: 503 no_replica until republished
        ("other", 1): ["r0"],
    }
    # Durable: a restarted router reads the same holders.
    again = AliasStore(tmp_path)
    assert again.aliases["a"].replicas == ["r0"] and again.aliases["solo"].replicas == []

    # The same URL again is a no-op: a retry does not take the replica off what it got since.
    _flip(router, "a", 3, ["r0", "r1"], keep=2)
    r = router.put("/v1/control/replicas/r1", json={"agent_url": "http://127.0.0.1:11"}, headers=H)
    assert r.status_code == 200 and _holders(router)[("a", 3)] == ["r0", "r1"]


@pytest.mark.parametrize(
    ("replica", "body", "status", "code"),
    [
        ("r9", {"agent_url": "http://127.0.0.1:11"}, 404, "not_found"),
        ("r" * 300, {"agent_url": "http://127.0.0.1:11"}, 400, "invalid_request"),
        ("r1", {"agent_url": "http://127.0.0.1:9"}, 400, "invalid_request"),  # r0's agent
        ("r1", {"agent_url": "ftp://127.0.0.1:11"}, 400, "invalid_request"),
        ("r1", {"agent_url": "http://u:p@127.0.0.1:11"}, 400, "invalid_request"),
        ("r1", {"agent_url": "http://127.0.0.1:11/v1"}, 400, "invalid_request"),
        ("r1", {"agent_url": "not a url"}, 400, "invalid_request"),
        ("r1", {"agent_url": ""}, 400, "invalid_request"),
        ("r1", {"agent_url": "http://127.0.0.1:11", "extra": 1}, 400, "invalid_request"),
        ("r1", {}, 400, "invalid_request"),
    ],
)
def test_bad_moves_are_precise_4xx_and_change_nothing(router, replica, body, status, code):
    _flip(router, "a", 1, ["r0", "r1"])
    r = router.put(f"/v1/control/replicas/{replica}", json=body, headers=H)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert [x.agent_url for x in router.app_.balancer.replicas] == OLD
    assert _holders(router) == {("a", 1): ["r0", "r1"]}


def test_moving_needs_the_control_token(router):
    body = {"agent_url": "http://127.0.0.1:11"}
    assert router.put("/v1/control/replicas/r1", json=body).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert router.put("/v1/control/replicas/r1", json=body, headers=bad).status_code == 403
    assert [x.agent_url for x in router.app_.balancer.replicas] == OLD


@pytest.mark.parametrize("old_answer", [200, 503])
def test_a_probe_in_flight_when_the_replica_moves_counts_for_nothing(old_answer):
    """The old address's answer (good or bad) arrives after the move: it must neither put the
    moved replica into rotation before its new URL answered nor count a failure against it."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from lorafleet.dataplane.balancer import Balancer
    from lorafleet.dataplane.health import HealthPoller
    from tests.router.helpers import serve_route

    async def scenario() -> None:
        asked, release = asyncio.Event(), asyncio.Event()

        async def health(request: web.Request) -> web.Response:
            asked.set()
            await release.wait()
            return web.Response(status=old_answer)

        runner, url = await serve_route("GET", "/health", health)
        try:
            balancer = Balancer([url])
            r = balancer.replicas[0]
            r.replica_id, r.engine_url, r.healthy, r.probed = "r0", "http://e0", True, True
            async with aiohttp.ClientSession() as session:
                poller = HealthPoller(balancer, session)
                poll = asyncio.create_task(poller._poll(r))
                await asyncio.wait_for(asked.wait(), 10)
                balancer.move(r, "http://127.0.0.1:11")
                release.set()
                await asyncio.wait_for(poll, 10)
        finally:
            await runner.cleanup()
        assert (r.healthy, r.probed, r.failures, r.successes) == (False, False, 0, 0)
        assert (
            r.engine_url is None and r.detail == "re-placed at http://127.0.0.1:11, not polled yet"
        )

    asyncio.run(scenario())


def test_a_request_in_flight_when_the_replica_moves_counts_no_failure_against_it():
    """The engine at the old address drops the request after the move: the request goes to the
    other replica, and the moved one is not charged a failure for its old address."""
    import asyncio
    import json

    import aiohttp
    from aiohttp import web

    from lorafleet.dataplane.balancer import Balancer
    from lorafleet.dataplane.metrics import RouterMetrics
    from lorafleet.dataplane.pipeline import Pipeline
    from tests.router.helpers import serve_completions

    async def scenario() -> None:
        asked, release = asyncio.Event(), asyncio.Event()

        async def dropping(request: web.Request) -> web.Response:
            asked.set()
            await release.wait()
            request.transport.close()  # type: ignore[union-attr]
            await asyncio.sleep(0.1)
            return web.Response()

        async def answering(request: web.Request) -> web.Response:
            body = await request.json()
            choice = {"text": "x", "index": 0, "finish_reason": "length"}
            return web.json_response({"id": "c", "model": body["model"], "choices": [choice]})

        (old, old_url), (ok, ok_url) = [await serve_completions(h) for h in (dropping, answering)]
        balancer = Balancer(["http://a0", "http://a1"])
        for i, (r, url) in enumerate(zip(balancer.replicas, (old_url, ok_url), strict=True)):
            r.replica_id, r.engine_url, r.healthy, r.probed = f"r{i}", url, True, True
            r.kind, r.base_model = "vllm", "tiny"
        balancer.replicas[1].inflight = 1  # busier: the request goes to r0 first
        balancer.reindex()
        store = AliasStore()
        store.set_alias("q", 1, "q@v1", ["r0", "r1"])
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b'{"model": "q", "prompt": "hi"}'}

        async def send(msg: dict) -> None:
            sent.append(msg)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        try:
            async with aiohttp.ClientSession() as http:
                proxy = Pipeline(store, balancer, RouterMetrics(), http)
                call = asyncio.create_task(proxy(scope, receive, send))
                await asyncio.wait_for(asked.wait(), 10)
                moved = balancer.replicas[0]
                balancer.move(moved, "http://127.0.0.1:11")
                release.set()
                await asyncio.wait_for(call, 30)
        finally:
            await old.cleanup()
            await ok.cleanup()
        assert sent[0]["status"] == 200, sent
        assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["model"] == "q"
        assert (moved.failures, moved.detail) == (
            0,
            "re-placed at http://127.0.0.1:11, not polled yet",
        )

    asyncio.run(scenario())
