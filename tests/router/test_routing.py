"""The router as a real process in front of real reference engines behind real agents.

The module shares one two-replica fleet; each test uses its own alias name. The last test kills
an engine, so it runs last (file order).
"""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from lorafleet.clients.router import AsyncRouterClient
from lorafleet.errors import RemoteError
from lorafleet.testing import wait_until
from tests.router.helpers import ctl, install_sync, set_alias, wait_healthy

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def router(launcher, fleet):
    r = fleet.start_router(launcher)
    wait_healthy(r, 2)
    return r


def complete(router, model, headers=None, timeout=30.0, **kw) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 0, **kw}
    return httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=timeout)


def sse(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_routes_by_version_with_tags(router, fleet, peft_dir):
    a, b = fleet.replicas
    en1 = install_sync([a.agent], peft_dir, "route", 1)
    en2 = install_sync([b.agent], peft_dir, "route", 2)
    assert set_alias(router, "route", 1, en1, [a.replica_id]).status_code == 200
    for _ in range(3):
        r = complete(router, "route")
        assert r.status_code == 200, r.text
        assert r.headers["X-Lorafleet-Adapter"] == "route"
        assert r.headers["X-Lorafleet-Adapter-Version"] == "1"
        assert r.headers["X-Lorafleet-Replica"] == a.replica_id
        body = r.json()
        assert body["model"] == "route"  # engine name rewritten back to the alias
        assert body["lorafleet"] == {
            "adapter": "route", "version": 1, "replica": a.replica_id, "engine_model": "route@v1"
        }  # fmt: skip
    r = set_alias(router, "route", 2, en2, [b.replica_id], expected_version=1)
    assert r.status_code == 200 and r.json()["seq"] == 2
    # The table with its flip log, and without it (what a publication reads).
    url = f"{router.url}/v1/control/aliases"
    full = httpx.get(url, headers=ctl(router), timeout=10).json()
    assert [e["version"] for e in full["log"] if e["name"] == "route"] == [1, 2]
    bare = httpx.get(url, params={"log": "false"}, headers=ctl(router), timeout=10).json()
    assert bare["log"] == [] and bare["aliases"] == full["aliases"]
    for _ in range(3):
        r = complete(router, "route")
        assert r.json()["lorafleet"]["version"] == 2
        assert r.headers["X-Lorafleet-Replica"] == b.replica_id
    # Streams: chunks pass through, then one tag chunk with empty choices before [DONE].
    r = complete(router, "route", stream=True)
    events = sse(r.text)
    assert events[-1] == "[DONE]" and len(events) >= 3
    tag = events[-2]
    assert tag["choices"] == [] and tag["lorafleet"]["version"] == 2
    assert tag["lorafleet"]["engine_model"] == "route@v2"
    assert all(e["model"] == "route" for e in events[:-1])
    assert r.headers["X-Lorafleet-Adapter-Version"] == "2"
    # Chat, plain and streamed.
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "route", "messages": msgs, "max_tokens": 3}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["lorafleet"]["version"] == 2 and r.json()["model"] == "route"
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "route", "messages": msgs, "max_tokens": 3, "stream": True}, timeout=30,
    )  # fmt: skip
    events = sse(r.text)
    assert events[-2]["object"] == "chat.completion.chunk" and events[-2]["choices"] == []
    # Native token-id generation.
    r = httpx.post(
        router.url + "/generate",
        json={"model": "route", "token_ids": [264, 365, 81], "sampling_params": {"max_tokens": 4}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    g = r.json()
    assert len(g["choices"][0]["token_ids"]) == 4 and g["choices"][0]["finish_reason"]
    assert g["lorafleet"]["version"] == 2
    # /v1/models lists the base model and the alias with its active version.
    models = {m["id"]: m for m in httpx.get(router.url + "/v1/models").json()["data"]}
    assert "tiny" in models and models["route"]["version"] == 2


def test_base_model_unknown_and_no_replica(router, fleet):
    seen = set()
    for _ in range(6):
        r = complete(router, "tiny")
        assert r.status_code == 200
        assert r.headers["X-Lorafleet-Adapter"] == "" and r.json()["lorafleet"]["version"] is None
        seen.add(r.headers["X-Lorafleet-Replica"])
    assert seen == {m.replica_id for m in fleet.replicas}  # idle replicas take turns
    r = complete(router, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "not_found" and "nope" in err["message"] and err["type"]
    # An alias must name replicas the router knows: this one is refused and never routed. (An
    # alias over a known replica that is down answers 503 no_replica: test_hostile.py.)
    r = set_alias(router, "ghost", 1, "ghost@v1", ["no-such-replica"])
    assert r.status_code == 409 and r.json()["error"]["code"] == "unknown_replica"
    assert complete(router, "ghost").status_code == 404


def test_a_replica_whose_engine_lacks_the_version_is_skipped(router, fleet, peft_dir):
    """The table lists b for ``lacks`` v1, but b's engine never loaded it (as after an engine
    restart the health poll has not seen yet): every request is served by a, and b leaves
    rotation until its agent says it is ready again."""
    a, b = fleet.replicas
    en = install_sync([a.agent], peft_dir, "lacks", 1)
    assert set_alias(router, "lacks", 1, en, [a.replica_id, b.replica_id]).status_code == 200
    served = []
    for _ in range(8):
        r = complete(router, "lacks")
        assert r.status_code == 200, r.text
        served.append(r.headers["X-Lorafleet-Replica"])
    assert set(served) == {a.replica_id}
    wait_healthy(router, 2)  # b is back once its agent says ready: the next test needs both


def test_openai_client_plain_and_streaming(router, fleet, peft_dir):
    import openai

    a, b = fleet.replicas
    en = install_sync([a.agent, b.agent], peft_dir, "oai", 1)
    set_alias(router, "oai", 1, en, [a.replica_id, b.replica_id])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    c = client.completions.create(model="oai", prompt="hello", max_tokens=3)
    assert c.model == "oai" and c.model_extra["lorafleet"]["version"] == 1
    chunks = list(client.completions.create(model="oai", prompt="hi", max_tokens=4, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].model_extra["lorafleet"]["adapter"] == "oai"
    assert "".join(ch.choices[0].text for ch in chunks[:-1])
    chat = list(
        client.chat.completions.create(
            model="oai", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert chat[-1].model_extra["lorafleet"]["version"] == 1
    assert [m.id for m in client.models.list()].count("oai") == 1


def test_inference_key_and_control_token_are_separate(launcher, fleet):
    r = fleet.start_router(launcher, api_key="inference-key")
    wait_healthy(r, 2)
    key = {"Authorization": "Bearer inference-key"}
    assert complete(r, "tiny").status_code == 401
    assert complete(r, "tiny", headers=ctl(r)).status_code == 403
    assert complete(r, "tiny", headers=key).status_code == 200
    assert httpx.get(r.url + "/v1/models", headers=ctl(r)).status_code == 403
    assert httpx.get(r.url + "/v1/models", headers=key).status_code == 200
    assert httpx.get(r.url + "/v1/control/aliases", headers=key).status_code == 403
    assert httpx.get(r.url + "/v1/control/aliases").status_code == 401
    assert httpx.get(r.url + "/v1/control/aliases", headers=ctl(r)).status_code == 200


def test_session_affinity_and_replacement_after_cutover(router, fleet, peft_dir):
    en1 = install_sync(fleet.agents, peft_dir, "sess", 1)
    set_alias(router, "sess", 1, en1, [m.replica_id for m in fleet.replicas])
    placed = {}
    for s in ("s1", "s2", "s3", "s4"):
        got = {
            complete(router, "sess", headers={"X-Session-ID": s}).headers["X-Lorafleet-Replica"]
            for _ in range(4)
        }
        assert len(got) == 1, got  # sticky
        placed[s] = got.pop()
    # v2 exists only on the replica s1 is NOT on: after the flip s1 must move there and stay.
    other = next(m for m in fleet.replicas if m.replica_id != placed["s1"])
    en2 = install_sync([other.agent], peft_dir, "sess", 2)
    set_alias(router, "sess", 2, en2, [other.replica_id])
    for _ in range(3):
        r = complete(router, "sess", headers={"X-Session-ID": "s1"})
        assert r.headers["X-Lorafleet-Replica"] == other.replica_id
        assert r.json()["lorafleet"]["version"] == 2


def _inflight(router, name, version) -> float:
    text = httpx.get(router.url + "/metrics").text
    want = f'lorafleet_router_inflight{{adapter="{name}",version="{version}"}}'
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return 0.0


def test_drain_waits_for_a_slow_stream_and_counts_disconnects(router, fleet, peft_dir):
    a, b = fleet.replicas
    en1 = install_sync([a.agent], peft_dir, "drn", 1)
    en2 = install_sync([b.agent], peft_dir, "drn", 2)
    en3 = install_sync([a.agent], peft_dir, "drn", 3)
    set_alias(router, "drn", 1, en1, [a.replica_id])
    result = {}

    def stream(timeout: float) -> None:
        try:
            result["r"] = complete(router, "drn", timeout=timeout, stream=True)
        except httpx.HTTPError as exc:
            result["r"] = exc

    # Freeze replica a's engine: the stream is routed there and stays in flight.
    a.engine.proc.signal(signal.SIGSTOP)
    try:
        t = threading.Thread(target=stream, args=(None,))
        t.start()
        wait_until(lambda: _inflight(router, "drn", 1) == 1, message="the stream in flight")
        set_alias(router, "drn", 2, en2, [b.replica_id])
        assert complete(router, "drn").json()["lorafleet"]["version"] == 2  # new ones go to v2
        body = {"version": 1, "timeout_s": 0.5}
        d = httpx.post(f"{router.url}/v1/control/aliases/drn/drain", json=body, headers=ctl(router))
        assert d.json() == {"name": "drn", "version": 1, "inflight": 1, "drained": False}
        active = {"version": 2, "timeout_s": 0}
        d = httpx.post(
            f"{router.url}/v1/control/aliases/drn/drain", json=active, headers=ctl(router)
        )
        assert d.status_code == 409
    finally:
        a.engine.proc.signal(signal.SIGCONT)
    t.join(30)
    events = sse(result["r"].text)
    assert events[-2]["lorafleet"]["version"] == 1  # finished on the version it started on
    body = {"version": 1, "timeout_s": 10}
    d = httpx.post(f"{router.url}/v1/control/aliases/drn/drain", json=body, headers=ctl(router))
    assert d.json()["drained"] is True and d.json()["inflight"] == 0

    # A client that leaves mid-request is no longer counted: the drain completes at once.
    wait_healthy(router, 2)
    set_alias(router, "drn", 3, en3, [a.replica_id])
    result.clear()
    a.engine.proc.signal(signal.SIGSTOP)
    try:
        t = threading.Thread(target=stream, args=(1.0,))
        t.start()
        wait_until(lambda: _inflight(router, "drn", 3) == 1, message="the stream in flight")
        t.join(10)
        assert isinstance(result["r"], httpx.TimeoutException), result
        wait_until(lambda: _inflight(router, "drn", 3) == 0, message="the disconnect counted")
    finally:
        a.engine.proc.signal(signal.SIGCONT)


def test_leases_cas_and_the_client(router, fleet, peft_dir):
    import asyncio

    a, b = fleet.replicas

    async def go() -> None:
        async with AsyncRouterClient(router.url, router.spec.token) as c:
            assert len((await c.replicas()).replicas) == 2
            await c.acquire_lease("lease", "pub-1", 30)
            with pytest.raises(RemoteError) as ei:
                await c.acquire_lease("lease", "pub-2", 30)
            assert ei.value.code == "publish_in_progress" and "pub-1" in ei.value.message
            await c.acquire_lease("lease", "pub-1", 30)  # renew
            with pytest.raises(RemoteError) as ei:
                await c.set_alias("lease", 1, "lease@v1", [a.replica_id])
            assert ei.value.code == "publish_in_progress"
            e = await c.set_alias("lease", 1, "lease@v1", [a.replica_id], lease_holder="pub-1")
            assert e.version == 1
            with pytest.raises(RemoteError) as ei:
                await c.set_alias("lease", 3, "lease@v3", [a.replica_id], 2, "pub-1")
            assert ei.value.code == "version_conflict" and ei.value.status == 409
            with pytest.raises(RemoteError) as ei:
                await c.set_alias("lease", 1, "lease@v1", [a.replica_id], 1, "pub-1")
            assert ei.value.code == "version_conflict"
            await c.set_alias("lease", 2, "lease@v2", [b.replica_id], 1, "pub-1")
            await c.release_lease("lease", "pub-1")
            await c.acquire_lease("lease", "pub-2", 30)
            await c.delete_alias("lease", lease_holder="pub-2")
            with pytest.raises(RemoteError) as ei:
                await c.delete_alias("lease", lease_holder="pub-2")
            assert ei.value.status == 404
            t = await c.table()
            log = [(e.version, e.engine_name) for e in t.log if e.name == "lease"]
            assert log == [(1, "lease@v1"), (2, "lease@v2"), (None, None)]
            assert "lease" not in t.aliases
            d = await c.drain("lease", 2, 1.0)
            assert d.drained

    asyncio.run(go())
    assert httpx.get(router.url + "/metrics").status_code == 200
    spec = httpx.get(router.url + "/openapi.json").json()["paths"]
    assert "/v1/completions" in spec and "/v1/control/aliases/{name}" in spec


def test_restart_keeps_the_alias_table(launcher, fleet, peft_dir, tmp_path):
    a, _ = fleet.replicas
    en = install_sync([a.agent], peft_dir, "keep", 1)
    r = fleet.start_router(launcher, state_dir=tmp_path / "state")
    wait_healthy(r, 2)
    set_alias(r, "keep", 1, en, [a.replica_id])
    before = httpx.get(r.url + "/v1/control/aliases", headers=ctl(r)).json()
    r2 = launcher.restart(r)  # same state dir, same port
    assert httpx.get(r2.url + "/v1/control/aliases", headers=ctl(r2)).json() == before
    wait_healthy(r2, 2)
    resp = complete(r2, "keep")
    assert resp.status_code == 200 and resp.json()["lorafleet"]["version"] == 1
    # CAS still works against the reloaded table.
    assert set_alias(r2, "keep", 2, en, [a.replica_id], expected_version=None).status_code == 409


def test_bad_input_on_every_route_is_a_precise_4xx(router):
    """Malformed, oversized and incomplete bodies are refused and change nothing."""
    url, auth = router.url, ctl(router)
    before = httpx.get(url + "/v1/control/aliases", headers=auth).json()
    cases = [
        ("post", "/v1/completions", {"content": b"{not json"}, {}, 400, "invalid_request"),
        ("post", "/v1/completions", {"content": b"[1, 2]"}, {}, 400, "invalid_request"),
        ("post", "/v1/chat/completions", {"content": b"x" * (33 << 20)}, {}, 413, "body_too_large"),
        ("put", "/v1/control/aliases/p", {"content": b"{not json"}, auth, 400, "invalid_request"),
        ("put", "/v1/control/aliases/p", {"json": {"version": 1}}, auth, 400, "invalid_request"),
        (
            "put",
            "/v1/control/aliases/p",
            {"json": {"version": 0, "engine_name": "p@v0", "replicas": ["x"]}},
            auth,
            400,
            "invalid_request",
        ),
        (
            "put",
            "/v1/control/aliases/p",
            {"content": b"{" + b" " * (2 << 20) + b"}"},
            auth,
            413,
            "body_too_large",
        ),
        (
            "post",
            "/v1/control/aliases/p/drain",
            {"json": {"version": "x"}},
            auth,
            400,
            "invalid_request",
        ),
        ("post", "/v1/control/leases/p", {"json": {}}, auth, 400, "invalid_request"),
        (
            "put",
            "/v1/control/aliases/p",
            {"json": {"version": 1, "engine_name": "p@v1", "replicas": ["x"]}},
            {},
            401,
            "unauthorized",
        ),
    ]
    for method, path, kw, headers, status, code in cases:
        r = getattr(httpx, method)(
            url + path, headers={"Content-Type": "application/json", **headers}, timeout=30, **kw
        )
        assert r.status_code == status, (path, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == code, (path, r.text[:200])
    assert httpx.get(url + "/v1/control/aliases", headers=auth).json() == before


def test_metrics_drop_retired_versions(router, fleet, peft_dir):
    a, _ = fleet.replicas
    names = {v: install_sync([a.agent], peft_dir, "metered", v) for v in (1, 2)}
    assert set_alias(router, "metered", 1, names[1], [a.replica_id]).status_code == 200
    assert complete(router, "metered").status_code == 200
    text = httpx.get(router.url + "/metrics").text
    assert 'adapter="metered",status="200",version="1"' in text
    assert set_alias(router, "metered", 2, names[2], [a.replica_id]).status_code == 200
    assert complete(router, "metered").status_code == 200
    text = httpx.get(router.url + "/metrics").text
    assert 'adapter="metered",status="200",version="2"' in text
    # v1 is neither active nor in flight: its series are gone, v2's stay
    assert not [ln for ln in text.splitlines() if 'adapter="metered"' in ln and 'version="1"' in ln]


def test_retry_once_when_an_engine_dies(launcher, fleet, peft_dir):
    """Runs last: it kills replica a's engine. A slow health poll keeps the dead replica in the
    table, so the first request sent there meets a refused connection and is retried on b."""
    a, b = fleet.replicas
    en = install_sync([a.agent, b.agent], peft_dir, "retry", 1)
    r = fleet.start_router(launcher, health_interval=30)
    wait_healthy(r, 2)
    set_alias(r, "retry", 1, en, [a.replica_id, b.replica_id])
    a.engine.proc.kill()
    for _ in range(6):
        resp = complete(r, "retry")
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Lorafleet-Replica"] == b.replica_id
    assert "lorafleet_router_retries_total 1.0" in httpx.get(r.url + "/metrics").text
    reps = {x["replica_id"]: x for x in httpx.get(r.url + "/v1/control/replicas",
                                                  headers=ctl(r)).json()["replicas"]}  # fmt: skip
    assert reps[a.replica_id]["healthy"] is False
