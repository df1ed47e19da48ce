"""Hostile input at the router: a precise 4xx for every bad name, holder or version, aliases only
over replicas it knows, leases an operator can break, and data-plane errors (plain or in a
stream) that never show engine-side names or a version tag.

In process: the control plane through FastAPI's TestClient (no lifespan, replica ids set by hand),
the data plane through ``Pipeline`` against canned aiohttp engines.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from fastapi.testclient import TestClient

from lorafleet.dataplane.balancer import Balancer
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.pipeline import Pipeline
from lorafleet.router.app import RouterConfig, create_app
from lorafleet.router.table import STATE_FILE, AliasStore
from tests.router.helpers import serve_completions

TOKEN = "ctl-t0ken"
H = {"Authorization": f"Bearer {TOKEN}"}
HOSTILE_PATHS = [
    "policy%0A",  # a trailing newline
    "%2E%2E",  # ..
    "a%00b",  # NUL
    "a" * 4096,
    "pol%E2%80%AEicy",  # right-to-left override
    "%FF%FE",  # not UTF-8
    "policy@v1",  # an engine-side name
    "-x",
]


@pytest.fixture
def router(tmp_path):
    app = create_app(RouterConfig(agents=["http://127.0.0.1:9"], control_token=TOKEN))
    app.balancer.replicas[0].replica_id = "r0"  # as if its agent had been polled
    client = TestClient(app.api, raise_server_exceptions=False)
    client.app_ = app  # type: ignore[attr-defined]
    return client


def _expect(r, status: int, code: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and r.headers["x-lorafleet-error-code"] == code
    if param is not None:
        assert err["param"] == param


def _flip(router, name: str, **body):
    body = {"version": 1, "engine_name": "p@v1", "replicas": ["r0"], **body}
    return router.put(f"/v1/control/aliases/{name}", json=body, headers=H)


# --- the control plane ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_PATHS)
def test_hostile_alias_names_are_400_and_store_nothing(router, name):
    _expect(_flip(router, name), 400, "invalid_name", "name")
    r = router.post(f"/v1/control/leases/{name}", json={"holder": "h"}, headers=H)
    _expect(r, 400, "invalid_name", "name")
    _expect(router.delete(f"/v1/control/aliases/{name}", headers=H), 400, "invalid_name")
    _expect(router.delete(f"/v1/control/leases/{name}", headers=H), 400, "invalid_name")
    r = router.post(f"/v1/control/aliases/{name}/drain", json={"version": 1}, headers=H)
    _expect(r, 400, "invalid_name")
    assert router.get("/v1/control/aliases", headers=H).json()["aliases"] == {}
    assert router.app_.store.leases == {}


@pytest.mark.parametrize("engine_name", ["", "p\n", "p@v1\n", "p@v0", "a b", "x" * 200])
def test_an_empty_or_hostile_engine_name_is_refused(router, engine_name):
    _expect(_flip(router, "p", engine_name=engine_name), 400, "invalid_name", "engine_name")
    assert router.app_.store.aliases == {}


def test_aliases_must_name_replicas_the_router_knows(router):
    r = _flip(router, "p", replicas=["r0", "no-such-replica"])
    _expect(r, 409, "unknown_replica", "replicas")
    assert "no-such-replica" in r.json()["error"]["message"]
    _expect(_flip(router, "p", replicas=["\x00"]), 409, "unknown_replica")
    _expect(_flip(router, "p", replicas=[]), 400, "invalid_request")
    assert _flip(router, "p").status_code == 200
    assert set(router.app_.store.aliases) == {"p"}


@pytest.mark.parametrize("version", [0, 2**63, 10**30])
def test_versions_out_of_range_are_400(router, version):
    _expect(_flip(router, "p", version=version), 400, "invalid_request", "version")
    _expect(_flip(router, "p", expected_version=version), 400, "invalid_request")
    r = router.post("/v1/control/aliases/p/drain", json={"version": version}, headers=H)
    _expect(r, 400, "invalid_request", "version")


@pytest.mark.parametrize("holder", ["", " ", "a\nb", "x" * 257, "\u202eh"])
def test_leases_need_a_holder(router, holder):
    r = router.post("/v1/control/leases/p", json={"holder": holder}, headers=H)
    _expect(r, 400, "invalid_name", "holder")
    _expect(_flip(router, "p", lease_holder=holder), 400, "invalid_name", "lease_holder")
    assert router.app_.store.leases == {}


def test_release_with_a_hostile_holder_is_400(router):
    _expect(router.delete("/v1/control/leases/p/a%0A", headers=H), 400, "invalid_name", "holder")
    _expect(
        router.delete("/v1/control/aliases/p?lease_holder=", headers=H),
        400,
        "invalid_name",
        "lease_holder",
    )


def test_an_operator_breaks_a_lease(router):
    assert router.post("/v1/control/leases/p", json={"holder": "dead:1:ab"}, headers=H).is_success
    r = router.post("/v1/control/leases/p", json={"holder": "alive"}, headers=H)
    _expect(r, 409, "publish_in_progress")
    _expect(router.delete("/v1/control/leases/p"), 401, "unauthorized")  # the token is needed
    assert router.delete("/v1/control/leases/p", headers=H).status_code == 204
    assert router.delete("/v1/control/leases/p", headers=H).status_code == 204  # idempotent
    r = router.post("/v1/control/leases/p", json={"holder": "alive"}, headers=H)
    assert r.status_code == 200 and r.json()["holder"] == "alive"


def test_a_stored_table_loses_what_the_rule_refuses(tmp_path):
    """A state file an older router wrote: hostile aliases and an empty-holder lease (which
    blocked the name for up to a day, across restarts) are dropped when it is loaded."""
    entry = {"version": 1, "engine_name": "p@v1", "replicas": ["r0"], "seq": 1}
    doc = {
        "aliases": {
            "good": {**entry, "name": "good"},
            "bad\n": {**entry, "name": "bad\n"},
            "..": {**entry, "name": ".."},
            "empty": {**entry, "name": "empty", "engine_name": ""},
        },
        "log": [],
        "seq": 1,
        "leases": {
            "good": {"holder": "", "expires_at": 4e9},
            "other": {"holder": "h", "expires_at": 4e9},
        },
    }
    (tmp_path / STATE_FILE).write_text(json.dumps(doc))
    store = AliasStore(tmp_path)
    assert set(store.aliases) == {"good"}
    assert set(store.leases) == {"other"}
    store.acquire_lease("good", "next", 60)  # no longer blocked


def test_models_lists_valid_aliases_by_their_public_names(router):
    assert _flip(router, "p", engine_name="p@v1").status_code == 200
    data = router.get("/v1/models").json()["data"]
    (card,) = [m for m in data if m["id"] == "p"]
    assert "p@v1" not in json.dumps(data) and card["version"] == 1


def test_openapi_documents_every_route(router, tmp_path):
    from prometheus_client import CONTENT_TYPE_LATEST

    spec = router.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(spec)
    paths = spec["paths"]
    assert paths["/v1/control/aliases/{name}"]["put"]["security"] == [{"controlToken": []}]
    flip = paths["/v1/control/aliases/{name}"]["put"]["responses"]
    assert set(flip) == {"200", "400", "401", "403", "409", "413"}
    name = paths["/v1/control/aliases/{name}"]["put"]["parameters"][0]["schema"]
    assert name["pattern"] == "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$" and name["maxLength"] == 128
    assert "delete" in paths["/v1/control/leases/{name}"]
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [CONTENT_TYPE_LATEST]
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        op = paths[path]["post"]
        assert {"200", "400", "404", "413", "502", "503"} <= set(op["responses"])
        assert "security" not in op  # no API key configured: the data plane is open
    streamed = paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}
    event = streamed["text/event-stream"]["schema"]  # one event's fields, not a string
    assert event["properties"]["data"] == {"type": "string"} and event["required"] == ["data"]
    # SGLang's /generate streams (stream: true); SkyRL's shape answers one JSON body.
    generate_ok = paths["/generate"]["post"]["responses"]["200"]["content"]
    assert set(generate_ok) == {"application/json", "text/event-stream"}
    keyed = create_app(RouterConfig(agents=[], control_token=TOKEN, api_key="k"))
    spec = TestClient(keyed.api).get("/openapi.json").json()
    assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"apiKey": []}]
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


# --- the data plane -------------------------------------------------------------------------------


class CannedEngine:
    """An engine whose answer to /v1/completions depends on the prompt."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode, model = body["prompt"], body.get("model")
        chunk = {"id": "c", "object": "text_completion", "model": model, "choices": [{"text": "x"}]}
        event = f"data: {json.dumps(chunk)}\n\n".encode()
        if mode == "missing":
            err = {"message": f"The model `{model}` does not exist; loaded: other@v7, {model}"}
            return web.json_response({"error": {**err, "code": 404}}, status=404)
        if mode == "short-body":  # declares more than it sends, then closes
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 1000
            await resp.prepare(request)
            await resp.write(b'{"id": "c", "choi')
            request.transport.close()  # type: ignore[union-attr]
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event)
        if mode == "ok":
            await resp.write(event + b"data: [DONE]\n\n")
        elif mode == "no-done":
            await resp.write(event)
        elif mode == "broken":  # half an event, then the connection drops
            await resp.write(event[:20])
            request.transport.close()  # type: ignore[union-attr]
            return resp
        elif mode == "error-event":
            err = {"error": {"message": f"adapter {model} failed (and other@v7)", "code": 500}}
            await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def start(self) -> tuple[web.AppRunner, str]:
        return await serve_completions(self.completions)


async def _call(proxy: Pipeline, body: dict) -> tuple[int, dict[str, str], bytes]:
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    got = False

    async def receive() -> dict:
        nonlocal got
        if got:  # the client stays until the answer is complete
            await asyncio.sleep(3600)
        got = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await proxy(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def _scenario(check) -> None:
    """Run ``check(call)`` against a proxy over one canned engine holding alias p -> p@v1; a
    second replica, r1, is known but down (its agent never answered)."""

    async def go() -> None:
        runner, url = await CannedEngine().start()
        balancer = Balancer(["http://a0", "http://a1"])
        rep, down = balancer.replicas
        rep.replica_id, rep.engine_url, rep.healthy, rep.kind = "r0", url, True, "vllm"
        rep.base_model = "tiny"
        down.replica_id = "r1"
        balancer.reindex()
        store = AliasStore()
        store.set_alias("p", 1, "p@v1", ["r0"])
        store.set_alias("gone", 1, "gone@v1", ["r1"])
        try:
            async with aiohttp.ClientSession() as http:
                proxy = Pipeline(store, balancer, RouterMetrics(), http)
                await check(lambda body: _call(proxy, body))
        finally:
            await runner.cleanup()

    asyncio.run(go())


def _events(raw: bytes) -> list[str]:
    return [e for e in raw.decode().split("\n\n") if e]


def test_model_names_outside_the_rule_are_400_not_a_dropped_connection():
    async def check(call) -> None:
        for model in ("policy\n", "a\x00", "x" * 300, "..", "p\u202e"):
            status, _, raw = await call({"model": model, "prompt": "ok"})
            assert status == 400, raw
            assert json.loads(raw)["error"]["code"] == "invalid_name"
        status, _, raw = await call({"model": "ghost", "prompt": "ok"})
        assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
        status, _, raw = await call({"model": "ghost@v1", "prompt": "ok"})
        assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"

    _scenario(check)


def test_an_alias_over_a_known_replica_that_is_down_is_503_no_replica():
    async def check(call) -> None:
        status, headers, raw = await call({"model": "gone", "prompt": "ok"})
        assert status == 503 and headers["retry-after"]
        assert json.loads(raw)["error"]["code"] == "no_replica"

    _scenario(check)


def test_engine_errors_never_show_engine_side_names():
    async def check(call) -> None:
        status, _, raw = await call({"model": "p", "prompt": "missing"})
        assert status == 404, raw
        assert b"@v" not in raw and b"`p`" in raw, raw

    _scenario(check)


def test_a_complete_stream_is_tagged_before_done():
    async def check(call) -> None:
        status, _, raw = await call({"model": "p", "prompt": "ok", "stream": True})
        events = _events(raw)
        assert status == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["lorafleet"]["version"] == 1

    _scenario(check)


@pytest.mark.parametrize("mode", ["no-done", "broken"])
def test_a_stream_that_fails_after_its_first_byte_ends_with_an_error_event(mode):
    async def check(call) -> None:
        status, headers, raw = await call({"model": "p", "prompt": mode, "stream": True})
        assert status == 200 and headers["x-lorafleet-adapter-version"] == "1"
        events = _events(raw)
        assert events[-1] == "data: [DONE]", raw
        err = json.loads(events[-2].removeprefix("data: "))
        assert err["error"]["code"] == "stream_interrupted", err
        payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]  # all whole
        assert not any("lorafleet" in p for p in payloads), raw  # never the version tag

    _scenario(check)


def test_an_engine_error_event_passes_without_the_tag_or_engine_names():
    async def check(call) -> None:
        status, _, raw = await call({"model": "p", "prompt": "error-event", "stream": True})
        events = _events(raw)
        assert status == 200 and events[-1] == "data: [DONE]", raw
        err = json.loads(events[-2].removeprefix("data: "))
        assert err["error"]["message"] == "adapter p failed (and other)", err
        assert not any("lorafleet" in e for e in events), raw

    _scenario(check)


def test_a_whole_answer_that_breaks_off_is_502():
    async def check(call) -> None:
        status, _, raw = await call({"model": "p", "prompt": "short-body"})
        assert status == 502, raw
        assert json.loads(raw)["error"]["code"] == "stream_interrupted"

    _scenario(check)
