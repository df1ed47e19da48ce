"""The front without a fleet: name mapping, control auth, path allow-list, bad input."""

from __future__ import annotations

import ipaddress
import json

import httpx
import pytest

from lorafleet.front import NameMap, TrainerName
from lorafleet.front.service import FrontConfig

DEAD = "http://127.0.0.1:9"  # nothing listens: any call to the fleet would fail loudly


def test_name_map_default():
    m = NameMap()
    assert m.parse("trl-policy-v7") == TrainerName("trl-policy", 7)
    assert m.parse("a-b-v12") == TrainerName("a-b", 12)
    assert m.parse("policy") == TrainerName("policy", None)
    assert m.parse("policy-v0") == TrainerName("policy-v0", None)
    assert m.parse("-v3") == TrainerName("-v3", None)
    assert NameMap.router_model(TrainerName("trl-policy", 7)) == "trl-policy@v7"


def test_name_map_custom_and_invalid():
    assert NameMap(r"^(?P<name>.+)_step(?P<version>\d+)$").parse("p_step4") == TrainerName("p", 4)
    with pytest.raises(ValueError, match="groups"):
        NameMap(r"^(?P<name>.+)$")
    with pytest.raises(ValueError, match="compile"):
        NameMap(r"(")


def cfg(tmp_path, **kw) -> FrontConfig:
    return FrontConfig(agents=[DEAD], router=DEAD, shared_dirs=[tmp_path], **kw)


def test_control_needs_a_token_by_default(tmp_path, serve_front):
    url = serve_front(cfg(tmp_path, trainer_token="t"))
    r = httpx.post(f"{url}/pause", params={"mode": "keep"})
    assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")
    assert r.headers["X-Lorafleet-Error-Code"] == "unauthorized"
    r = httpx.post(f"{url}/resume", headers={"Authorization": "Bearer nope"})
    assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden")
    r = httpx.post(f"{url}/pause", params={"mode": "keep"}, headers={"Authorization": "Bearer t"})
    assert r.status_code == 200 and r.json()["status"] == "paused"
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    assert httpx.get(f"{url}/health").status_code == 200


def test_tokenless_control_only_from_allow_listed_addresses(tmp_path, serve_front):
    url = serve_front(cfg(tmp_path, allow_unauthenticated_control=True))
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}).status_code == 200
    assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}
    r = httpx.post(f"{url}/pause", params={"mode": "sideways"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "mode")

    elsewhere = [ipaddress.ip_network("10.0.0.0/8")]
    url = serve_front(
        cfg(tmp_path, allow_unauthenticated_control=True, control_allow_from=elsewhere)
    )
    r = httpx.post(f"{url}/resume")
    assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden")
    assert "allow-listed" in r.json()["error"]["message"]


def test_load_refuses_paths_outside_the_shared_dirs(tmp_path, serve_front):
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "private").mkdir()
    url = serve_front(
        FrontConfig(
            agents=[DEAD], router=DEAD, shared_dirs=[shared], allow_unauthenticated_control=True
        )
    )

    def load(path: str, name: str = "p-v1") -> httpx.Response:
        body = {"lora_name": name, "lora_path": path}
        return httpx.post(f"{url}/v1/load_lora_adapter", json=body)

    for path in (str(tmp_path / "private"), str(shared / ".." / "private"), "/etc"):
        r = load(path)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "path_not_allowed"), path
    (shared / "link").symlink_to(tmp_path / "private")
    assert load(str(shared / "link")).status_code == 403
    r = load(str(shared / "missing"))
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_path")
    r = load(str(shared / ".lorafleet-handover"))
    assert r.status_code == 403
    (shared / "empty").mkdir()
    r = load(str(shared / "empty"))  # not an adapter: refused before the fleet is contacted
    assert r.status_code in (400, 422) and r.json()["error"]["param"] in ("lora_path", None), r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "p-v1"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
    r = httpx.post(f"{url}/v1/load_lora_adapter", content=b"{not json")
    assert r.status_code == 400


def test_fleet_unreachable_is_503_not_500(tmp_path, serve_front):
    url = serve_front(cfg(tmp_path, allow_unauthenticated_control=True))
    for r in (
        httpx.get(f"{url}/v1/models"),
        httpx.get(f"{url}/server_info", params={"config_format": "json"}),
        httpx.post(f"{url}/v1/completions", json={"model": "p-v1", "prompt": "a"}),
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "p-v1"}),
    ):
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_unavailable"), r.text


def test_version_zero_is_the_base_model():
    m = NameMap()
    assert m.is_base("policy-v0") and m.is_base("a-b-v00")
    assert not m.is_base("policy-v1") and not m.is_base("policy") and not m.is_base("-v0")
    assert not m.is_base(None) and not m.is_base(["policy-v0"])


def test_an_aborted_generate_answers_as_sglang():
    from lorafleet.front.dialects.sglang import aborted_generate

    one = aborted_generate({"input_ids": [1, 2, 3], "return_logprob": True, "rid": "r1"})
    assert one["output_ids"] == [] and one["text"] == ""
    assert one["meta_info"]["id"] == "r1" and one["meta_info"]["prompt_tokens"] == 3
    assert one["meta_info"]["finish_reason"]["type"] == "abort"
    assert one["meta_info"]["output_token_logprobs"] == []
    batch = aborted_generate({"text": ["a", "b"]})
    assert [b["meta_info"]["finish_reason"]["type"] for b in batch] == ["abort", "abort"]
    assert "output_token_logprobs" not in batch[0]["meta_info"]


# --- the front reaches engines through their kinds' backends -----------------------------------


def _replica(i: int, kind: str, url: str):
    from lorafleet.protocol.agent import AgentInfo, EngineCapabilities

    caps = EngineCapabilities(kind=kind)
    return AgentInfo(
        replica_id=f"r{i}", engine_url=url, base_model="/models/tiny", capabilities=caps, ready=True
    )


async def _front_over(tmp_path, replicas, answers):
    """A front whose agents told it ``replicas`` (AgentInfo); ``answers``: engine URL -> the
    handler its backend answers through (a URL without one is called for real)."""
    from lorafleet.front.service import Front

    front = Front(cfg(tmp_path))
    front._infos = list(replicas)
    for info in replicas:
        handler = answers.get(info.engine_url)
        if handler is None:
            continue
        backend = front._engine(info)
        await backend.http.aclose()
        backend.http = httpx.AsyncClient(
            base_url=backend.url, transport=httpx.MockTransport(handler)
        )
    return front


def test_prefix_cache_outcomes_per_replica(tmp_path):
    """Each kind's answer, as the SkyRL dialect reports it (one outcome per replica)."""
    import asyncio

    calls: list[str] = []

    def vllm_dev_off(request: httpx.Request) -> httpx.Response:
        calls.append(f"vllm {request.url.path}?{request.url.query.decode()}")
        return httpx.Response(404, json={"detail": "Not Found"})

    def sglang(request: httpx.Request) -> httpx.Response:
        calls.append(f"sglang {request.url.path}")
        return httpx.Response(200, text="Cache flushed.")

    def sglang_busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, text="Cache not flushed because there are pending requests.")

    replicas = [
        _replica(0, "vllm", "http://vllm"),
        _replica(1, "sglang", "http://sglang"),
        _replica(2, "reference", "http://reference"),
        _replica(3, "vllm", DEAD),
        _replica(4, "sglang", "http://busy"),
    ]
    answers = {"http://vllm": vllm_dev_off, "http://sglang": sglang, "http://busy": sglang_busy}

    async def go():
        front = await _front_over(tmp_path, replicas, answers)
        try:
            return await front.reset_prefix_caches(True)
        finally:
            await front.aclose()
            assert not front._engines  # closed with the front

    out = asyncio.run(go())
    assert calls == ["vllm /reset_prefix_cache?reset_running_requests=true", "sglang /flush_cache"]
    unreachable = out.pop(3)
    assert unreachable.pop("detail")
    assert unreachable == {"replica": "r3", "kind": "vllm", "result": "unreachable"}
    assert out == [
        {
            "replica": "r0",
            "kind": "vllm",
            "result": "not_exposed",
            "detail": "start vLLM with VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache",
        },
        {"replica": "r1", "kind": "sglang", "result": "reset"},
        {"replica": "r2", "kind": "reference", "result": "no_prefix_cache"},
        {
            "replica": "r4",
            "kind": "sglang",
            "result": "refused",
            "detail": "Cache not flushed because there are pending requests.",
        },
    ]


def test_tokenize_goes_to_the_first_engine_that_answers(tmp_path):
    import asyncio

    from lorafleet.errors import EngineUnavailable

    def models(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})

    def tokenizer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return models(request)
        assert request.url.path == "/tokenize"
        body = json.loads(request.content)
        return httpx.Response(200, json={"tokens": [len(body["prompt"])], "model": body["model"]})

    async def go():
        # The base model's card comes from the first replica's engine, which answers only that.
        up = await _front_over(
            tmp_path,
            [_replica(0, "vllm", "http://models"), _replica(1, "vllm", DEAD),
             _replica(2, "sglang", "http://tok")],
            {"http://models": models, "http://tok": tokenizer},
        )  # fmt: skip
        try:
            assert await up.base_model() == {
                "id": "tiny", "max_model_len": 64, "root": "/models/tiny"
            }  # fmt: skip
            up._infos = up._infos[1:]  # the first tokenizing engine is down
            reply = await up.tokenize({"prompt": "abc", "model": "ignored"})
        finally:
            await up.aclose()
        down = await _front_over(tmp_path, [_replica(0, "vllm", DEAD)], {})
        down._base = {"id": "tiny"}
        try:
            with pytest.raises(EngineUnavailable, match="no engine answered /detokenize"):
                await down.detokenize({"tokens": [1]})
        finally:
            await down.aclose()
        return reply

    reply = asyncio.run(go())
    assert reply.status_code == 200
    assert json.loads(reply.content) == {"tokens": [3], "model": "tiny"}  # the base model's name


def test_finish_session_carries_the_router_key_and_a_refusal_is_503(tmp_path):
    import asyncio

    from lorafleet.errors import EngineUnavailable
    from lorafleet.front.service import Front

    def router(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/finish_session")
        if request.headers.get("authorization") != "Bearer key":
            return httpx.Response(403, json={"error": {"code": "forbidden", "message": "no"}})
        return httpx.Response(200, json={"ok": True})

    async def go(api_key: str) -> None:
        front = Front(cfg(tmp_path, fleet_token="ctl", api_key=api_key))
        # The front's own router client (its keys), over a mocked connection pool.
        http = httpx.AsyncClient(transport=httpx.MockTransport(router))
        front.router._client = http
        try:
            assert await front.finish_session("s") == {"ok": True}
        finally:
            await http.aclose()
            await front.aclose()

    asyncio.run(go("key"))
    with pytest.raises(EngineUnavailable, match="the router answered 403 to finish_session"):
        asyncio.run(go("ctl"))
