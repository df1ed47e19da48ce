"""The backends' LoRA-agnostic calls (what the front asks an engine): the base model's card, a
prefix-cache reset, tokenize and detokenize. Each kind's facts are the backend's: vLLM's reset
is a development route (404: not exposed), SGLang's is ``/flush_cache`` and answers
``{"text"}`` on detokenize, the reference engine keeps no prefix cache."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from lorafleet.agent.backends import EngineUnavailable, make_backend
from lorafleet.agent.backends.base import EngineBackend
from lorafleet.engine_kinds import EngineReply, PrefixCacheReset

DEAD = "http://127.0.0.1:9"  # nothing listens: every call is refused at connect
PROMPT = "The quick brown fox"
NOT_EXPOSED = PrefixCacheReset(
    "not_exposed", "start vLLM with VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache"
)

Handler = Callable[[httpx.Request], httpx.Response]


def run(coro):
    return asyncio.run(coro)


async def mocked(kind: str, handler: Handler) -> EngineBackend:
    """``kind``'s backend answering through ``handler`` (no engine behind it)."""
    backend = make_backend(kind, "http://engine")
    assert isinstance(backend, EngineBackend)
    await backend.http.aclose()
    backend.http = httpx.AsyncClient(base_url=backend.url, transport=httpx.MockTransport(handler))
    return backend


async def _reset(kind: str, handler: Handler, running: bool = False) -> PrefixCacheReset:
    backend = await mocked(kind, handler)
    try:
        return await backend.reset_prefix_cache(running)
    finally:
        await backend.aclose()


def _refuse_connect(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


# --- against real engines: the reference engine here, vLLM and SGLang in their tiers --------------


@pytest.mark.parametrize(
    ("kind", "server"),
    [
        ("reference", "reference_engine"),
        pytest.param("vllm", "vllm_server", marks=pytest.mark.vllm),
        pytest.param("sglang", "sglang_server", marks=pytest.mark.sglang),
    ],
)
def test_the_front_calls_against_a_real_engine(kind, server, request, tiny_model):
    from transformers import AutoTokenizer

    eng = request.getfixturevalue(server)
    ids = AutoTokenizer.from_pretrained(tiny_model)(PROMPT).input_ids

    async def go():
        backend = make_backend(kind, eng.url)
        try:
            cards = await backend.models()
            base = await backend.base_card()
            # vLLM mints a fresh permission id on every /v1/models call: compare cards by id.
            assert base["id"] in {c["id"] for c in cards} and not base.get("parent")
            done = await backend.reset_prefix_cache(True)
            tok = await backend.tokenize({"model": base["id"], "prompt": PROMPT})
            detok = await backend.detokenize({"model": base["id"], "tokens": ids})
            return done, tok, detok
        finally:
            await backend.aclose()

    done, tok, detok = run(go())
    want = {
        "reference": [PrefixCacheReset("no_prefix_cache")],
        # The reset route exists only in vLLM's development mode, which the tier may not set.
        "vllm": [PrefixCacheReset("reset"), NOT_EXPOSED],
        "sglang": [PrefixCacheReset("reset")],
    }[kind]
    assert done in want
    assert tok.status_code == 200 and "application/json" in tok.media_type
    assert json.loads(tok.content)["tokens"] == ids
    assert detok.status_code == 200
    assert json.loads(detok.content)["prompt"] == PROMPT


def test_an_engine_error_is_relayed_as_it_came(reference_engine):
    async def go():
        backend = make_backend("reference", reference_engine.url)
        try:
            return await backend.detokenize({"tokens": "not a list"})
        finally:
            await backend.aclose()

    reply = run(go())
    assert reply.status_code == 400 and "tokens" in json.loads(reply.content)["error"]["message"]


@pytest.mark.parametrize("kind", ["reference", "vllm", "sglang"])
def test_no_engine_listening(kind):
    """Connection refused: a reset says ``unreachable`` (never raises), the rest raise
    ``EngineUnavailable``."""

    async def go():
        backend = make_backend(kind, DEAD)
        try:
            done = await backend.reset_prefix_cache(False)
            for call in (
                backend.models(),
                backend.base_card(),
                backend.tokenize({"prompt": "a"}),
                backend.detokenize({"tokens": [1]}),
            ):
                with pytest.raises(EngineUnavailable, match="unreachable"):
                    await call
            return done
        finally:
            await backend.aclose()

    done = run(go())
    if kind == "reference":
        assert done == PrefixCacheReset("no_prefix_cache")  # it never calls the engine
    else:
        assert done.result == "unreachable" and done.detail


# --- each kind's answers, from recorded shapes ----------------------------------------------------


def test_vllm_reset_prefix_cache_answers():
    seen: list[httpx.Request] = []

    def answering(status: int, text: str = "") -> Handler:
        def handler(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return httpx.Response(status, text=text)

        return handler

    assert run(_reset("vllm", answering(200), True)) == PrefixCacheReset("reset")
    assert seen[-1].method == "POST" and seen[-1].url.path == "/reset_prefix_cache"
    assert seen[-1].url.params["reset_running_requests"] == "true"
    run(_reset("vllm", answering(200), False))
    assert seen[-1].url.params["reset_running_requests"] == "false"
    # Without VLLM_SERVER_DEV_MODE=1 the route does not exist: FastAPI's bare 404.
    not_found = answering(404, '{"detail":"Not Found"}')
    assert run(_reset("vllm", not_found)) == NOT_EXPOSED
    refused = run(_reset("vllm", answering(500, "x" * 600)))
    assert refused == PrefixCacheReset("refused", "x" * 500)  # the answer, cut at 500 characters
    unreachable = run(_reset("vllm", _refuse_connect))
    assert unreachable == PrefixCacheReset("unreachable", "connection refused")


def test_sglang_reset_is_flush_cache_and_its_404_is_a_refusal():
    seen: list[httpx.Request] = []

    def answering(status: int, text: str = "") -> Handler:
        def handler(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return httpx.Response(status, text=text)

        return handler

    assert run(_reset("sglang", answering(200, "Cache flushed."), True)) == (
        PrefixCacheReset("reset")
    )
    assert seen[-1].method == "POST" and seen[-1].url.path == "/flush_cache"
    assert not seen[-1].url.params  # SGLang's flush takes no reset_running_requests
    busy = "Cache not flushed because there are pending requests."
    assert run(_reset("sglang", answering(400, busy))) == PrefixCacheReset("refused", busy)
    # SGLang always has the route: a 404 is a refusal like any other, not "not exposed".
    missing = run(_reset("sglang", answering(404, '{"detail":"Not Found"}')))
    assert missing == PrefixCacheReset("refused", '{"detail":"Not Found"}')
    unreachable = run(_reset("sglang", _refuse_connect))
    assert unreachable == PrefixCacheReset("unreachable", "connection refused")


def test_the_reference_engine_keeps_no_prefix_cache():
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"the reference backend called {request.url.path}")

    assert run(_reset("reference", handler)) == PrefixCacheReset("no_prefix_cache")


def test_sglang_detokenize_also_answers_vllms_prompt():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/detokenize"
        if json.loads(request.content)["tokens"] == [0]:
            return httpx.Response(400, json={"error": "bad token"})
        return httpx.Response(200, json={"text": "hi"})

    async def go(tokens: list[int]) -> EngineReply:
        backend = await mocked("sglang", handler)
        try:
            return await backend.detokenize({"tokens": tokens})
        finally:
            await backend.aclose()

    ok = run(go([1, 2]))
    assert ok.status_code == 200 and json.loads(ok.content) == {"text": "hi", "prompt": "hi"}
    bad = run(go([0]))  # an error answer is relayed untouched
    assert bad.status_code == 400 and json.loads(bad.content) == {"error": "bad token"}


def test_vllm_tokenize_is_relayed_untouched():
    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/tokenize")
        assert json.loads(request.content) == {"model": "base", "prompt": "a"}
        return httpx.Response(
            404,
            content=b'{"error":{"message":"The model `base` does not exist."}}',
            headers={"content-type": "application/json; charset=utf-8"},
        )

    async def go() -> EngineReply:
        backend = await mocked("vllm", handler)
        try:
            return await backend.tokenize({"model": "base", "prompt": "a"})
        finally:
            await backend.aclose()

    assert run(go()) == EngineReply(
        404,
        b'{"error":{"message":"The model `base` does not exist."}}',
        "application/json; charset=utf-8",
    )


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_base_card_is_the_card_without_a_parent(kind):
    cards = [
        {"id": "lora-a", "parent": "tiny", "root": "/a"},
        {"id": "tiny", "root": "/models/tiny", "max_model_len": 2048, "parent": None},
        {"no": "id"},
    ]

    def answering(status: int, body: object) -> Handler:
        def handler(request: httpx.Request) -> httpx.Response:
            assert (request.method, request.url.path) == ("GET", "/v1/models")
            return httpx.Response(status, json=body)

        return handler

    async def go(handler: Handler) -> dict:
        backend = await mocked(kind, handler)
        try:
            return await backend.base_card(timeout=10.0)
        finally:
            await backend.aclose()

    assert run(go(answering(200, {"data": cards}))) == cards[1]
    with pytest.raises(EngineUnavailable, match="no base model"):
        run(go(answering(200, {"data": cards[:1]})))
    with pytest.raises(EngineUnavailable, match="answered 500"):
        run(go(answering(500, {"detail": "boom"})))
    with pytest.raises(EngineUnavailable, match="no model list"):
        run(go(answering(200, ["not", "an", "object"])))
