"""Every replica is addressed in its own engine's dialect (lorafleet.engine_kinds).

Real SGLang 0.5.23 serves the base model for a bare adapter name in ``model`` and applies the
adapter only for ``"<base>:<name>"`` (docs/engines/sglang.md); vLLM wants the bare name. The
router must send each replica what its engine applies, show the client its own alias back, and
never let a client's ``lora_path`` pick another adapter than the one the response is tagged with.
These drive the proxy in-process against recording engines; tests/contract runs the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
from aiohttp import web

from lorafleet.dataplane.balancer import Balancer
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.pipeline import Pipeline
from lorafleet.engine_kinds import address, model_field
from lorafleet.router.table import AliasStore
from tests.router.helpers import serve_completions


def test_model_field_per_kind():
    assert model_field("vllm", "tiny", "p@v3") == "p@v3"
    assert model_field("reference", "tiny", "p@v3") == "p@v3"
    assert model_field("sglang", "tiny", "p@v3") == "tiny:p@v3"
    assert model_field("sglang", "tiny", None) == "tiny"
    body = {"model": "p", "prompt": "x", "lora_path": "other"}
    assert address(body, "sglang", "tiny", "p@v3") == {"model": "tiny:p@v3", "prompt": "x"}
    assert address(body, "vllm", "tiny", None) == {"model": "p", "prompt": "x"}


class RecordingEngine:
    """Answers completions, echoing the ``model`` it was sent; 404 for unknown engine names."""

    def __init__(self, known: set[str]) -> None:
        self.known = known
        self.bodies: list[dict] = []

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if body["model"] not in self.known:
            err = {"message": f"The model `{body['model']}` does not exist.", "code": 404}
            return web.json_response({"error": err}, status=404)
        return web.json_response({"id": "c", "model": body["model"], "choices": [{"text": "x"}]})

    async def start(self) -> tuple[web.AppRunner, str]:
        return await serve_completions(self.completions)


async def _call(proxy: Pipeline, body: dict) -> tuple[int, dict]:
    raw = json.dumps(body).encode()
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await proxy({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                receive, send)  # fmt: skip
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@contextlib.asynccontextmanager
async def two_replicas(vllm: RecordingEngine, sglang: RecordingEngine):
    """A proxy over a vLLM and an SGLang replica (ids ``vllm``, ``sglang``) that both hold
    ``p`` v1 in the table; yields (proxy, store, balancer)."""
    runners = []
    balancer = Balancer(["http://a0", "http://a1"])
    engines = [("vllm", vllm), ("sglang", sglang)]
    try:
        for rep, (kind, engine) in zip(balancer.replicas, engines, strict=True):
            runner, url = await engine.start()
            runners.append(runner)
            rep.replica_id, rep.engine_url, rep.healthy = kind, url, True
            rep.kind, rep.base_model = kind, "tiny"
        balancer.reindex()
        store = AliasStore()
        store.set_alias("p", 1, "p@v1", ["vllm", "sglang"])
        async with aiohttp.ClientSession() as http:
            yield Pipeline(store, balancer, RouterMetrics(), http), store, balancer
    finally:
        for runner in runners:
            await runner.cleanup()


def test_each_replica_gets_its_dialect_and_the_client_its_alias():
    vllm = RecordingEngine({"p@v1", "tiny"})
    sglang = RecordingEngine({"tiny:p@v1", "tiny"})

    async def scenario() -> None:
        async with two_replicas(vllm, sglang) as (proxy, _store, _balancer):
            seen = set()
            for _ in range(4):
                status, body = await _call(proxy, {"model": "p", "prompt": "hi", "lora_path": "z"})
                assert status == 200, body
                assert body["model"] == "p"  # the client's alias, whatever the engine said
                seen.add((body["lorafleet"]["replica"], body["lorafleet"]["engine_model"]))
            assert seen == {("vllm", "p@v1"), ("sglang", "tiny:p@v1")}
            assert {b["model"] for b in vllm.bodies} == {"p@v1"}
            assert {b["model"] for b in sglang.bodies} == {"tiny:p@v1"}
            assert not any("lora_path" in b for b in vllm.bodies + sglang.bodies)

            # A base-model request carrying lora_path would pick an adapter on SGLang while the
            # response says "base": the router drops the field.
            status, body = await _call(proxy, {"model": "tiny", "prompt": "hi", "lora_path": "z"})
            assert status == 200 and body["lorafleet"]["adapter"] is None
            assert "lora_path" not in (vllm.bodies + sglang.bodies)[-1]

            # An engine's error shows the client's alias, never the engine-side name.
            vllm.known.discard("p@v1")
            sglang.known.discard("tiny:p@v1")
            status, body = await _call(proxy, {"model": "p", "prompt": "hi"})
            assert status == 404 and "p@v1" not in json.dumps(body), body
            assert "`p`" in body["error"]["message"]

    asyncio.run(scenario())


class RestartedSGLang(RecordingEngine):
    """A real SGLang's answer for an adapter it never saw (it restarted empty): a 400."""

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if body["model"] in self.known:
            return web.json_response({"id": "c", "model": body["model"], "choices": [{}]})
        message = (
            f"Got LoRA adapter that has never been loaded: {body['model'].split(':', 1)[-1]}\n"
            "All loaded adapters: dict_keys([])."
        )
        return web.json_response({"object": "error", "message": message, "code": 400}, status=400)


def test_a_replica_whose_engine_lacks_the_version_hands_the_request_on_in_its_dialect():
    """Each kind says "I do not hold it" its own way (vLLM 404, SGLang 400 "never been
    loaded"); either way the request goes to a replica that holds the version, and one that
    refuses for another reason is relayed as it is."""
    vllm = RecordingEngine({"p@v1", "tiny"})
    sglang = RestartedSGLang({"tiny"})

    async def scenario() -> None:
        async with two_replicas(vllm, sglang) as (proxy, store, balancer):
            tried = 0
            for _ in range(4):
                balancer.replicas[1].healthy = True  # as its probe would say: its agent is up
                before = len(sglang.bodies)
                status, body = await _call(proxy, {"model": "p", "prompt": "hi"})
                assert status == 200, body
                assert body["lorafleet"]["replica"] == "vllm"
                if len(sglang.bodies) > before:  # it was tried, and taken out of rotation
                    tried += 1
                    assert sglang.bodies[-1]["model"] == "tiny:p@v1"
                    assert not balancer.replicas[1].healthy
                    assert "does not hold p@v1" in balancer.replicas[1].detail
            assert tried >= 1
            # The only holder lacking it: its own answer, as SGLang gave it (alias scrubbed).
            store.set_alias("p", 2, "p@v2", ["sglang"], expected_version=1)
            status, body = await _call(proxy, {"model": "p", "prompt": "hi"})
            assert status == 400 and "never been loaded" in body["message"], body
            assert "p@v2" not in json.dumps(body)

    asyncio.run(scenario())
