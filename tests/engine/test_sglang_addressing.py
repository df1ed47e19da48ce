"""SGLang's addressing, as real SGLang 0.5.23 does it and the reference engine's ``--dialect
sglang`` copies it: each test runs on both (``sglang_engine``), so the fast tier fails where a real
SGLang replica would.

Observed on sglang 0.5.23 (CPU engine, torch_native LoRA backend), docs/engines/sglang.md:

- ``model: "<adapter>"`` (bare) on the OpenAI routes answers 200 with the **base** model's output
  and echoes the bare name; so does an unknown bare name.
- ``model: "<base>:<adapter>"`` and ``lora_path: "<adapter>"`` apply the adapter; native
  ``/generate`` takes ``lora_path``.
- ``<base>:<never loaded>`` is a 400 naming the adapter; there is no ``/v1/load_lora_adapter``.
- ``/server_info`` reports the LoRA limits the server was started with.

The real server remembers every name it ever loaded, so names here are used by no other test.
"""

from __future__ import annotations

import pytest

from tests.engine.helpers import PROMPT, expected

pytestmark = pytest.mark.timeout(300)


def _load(t, name: str, path) -> None:
    r = t.client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    assert r.json()["loaded_adapters"][name] == str(path)


def _unload(t, name: str) -> None:
    r = t.client.post("/unload_lora_adapter", json={"lora_name": name})
    assert r.status_code == 200, r.text


def _completion(t, **body) -> tuple[int, dict]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    r = t.client.post("/v1/completions", json=body)
    return r.status_code, r.json()


def _chat(t, **body) -> tuple[int, dict]:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "temperature": 0,
        **body,
    }
    r = t.client.post("/v1/chat/completions", json=body)
    return r.status_code, r.json()


def _generate(t, **body) -> str:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, **body}
    r = t.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def test_openai_routes_apply_only_base_colon_name_or_lora_path(sglang_engine, adapters, tiny_model):
    """The failure this tier exists for: a bare adapter name is a 200 with base output."""
    t = sglang_engine
    name = f"addr-{t.kind}"
    base_text = expected(str(tiny_model), None)
    adapter_text = expected(str(tiny_model), str(adapters["a"]))
    assert base_text != adapter_text
    _load(t, name, adapters["a"])
    try:
        status, body = _completion(t, model=t.model)
        assert (status, body["choices"][0]["text"]) == (200, base_text)

        # A bare adapter name: 200, the base model's output, the bare name echoed.
        status, body = _completion(t, model=name)
        assert status == 200, body
        assert body["model"] == name
        assert body["choices"][0]["text"] == base_text
        status, body = _completion(t, model="addr-nosuch")
        assert (status, body["choices"][0]["text"]) == (200, base_text)

        # <base>:<name> and lora_path apply it; the suffix of model wins over lora_path.
        status, body = _completion(t, model=f"{t.model}:{name}")
        assert (status, body["model"]) == (200, f"{t.model}:{name}")
        assert body["choices"][0]["text"] == adapter_text
        status, body = _completion(t, model=t.model, lora_path=name)
        assert (status, body["choices"][0]["text"]) == (200, adapter_text)
        # The prefix is not checked.
        status, body = _completion(t, model=f"policy:{name}")
        assert (status, body["choices"][0]["text"]) == (200, adapter_text)

        # Chat: the same addressing (the chat template changes the text, not the rule).
        status, base_chat = _chat(t, model=t.model)
        assert status == 200, base_chat
        status, bare_chat = _chat(t, model=name)
        assert status == 200, bare_chat
        assert bare_chat["choices"][0]["message"] == base_chat["choices"][0]["message"]
        status, colon_chat = _chat(t, model=f"{t.model}:{name}")
        assert status == 200, colon_chat
        assert colon_chat["choices"][0]["message"] != base_chat["choices"][0]["message"]

        # Native /generate: lora_path applies it; model is not read.
        assert _generate(t) == base_text
        assert _generate(t, lora_path=name) == adapter_text

        # An adapter named with a colon that was never loaded: 400 that names it.
        status, body = _completion(t, model=f"{t.model}:addr-never")
        assert status == 400, body
        assert body["message"].startswith("Got LoRA adapter that has never been loaded: addr-never")
    finally:
        _unload(t, name)


def test_unloaded_name_is_reloaded_from_its_path(sglang_engine, adapters, tiny_model):
    """Unload is not final: the next request naming the adapter re-reads its remembered path."""
    t = sglang_engine
    name = f"reload-{t.kind}"
    _load(t, name, adapters["b"])
    _unload(t, name)
    assert name not in {c["id"] for c in t.client.get("/v1/models").json()["data"]}
    assert _generate(t, lora_path=name) == expected(str(tiny_model), str(adapters["b"]))
    assert name in {c["id"] for c in t.client.get("/v1/models").json()["data"]}
    # And a load of the re-loaded name is "already loaded", whatever the path.
    r = t.client.post(
        "/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters["a"])}
    )
    assert r.status_code == 400
    assert "already loaded" in r.json()["error_message"]
    _unload(t, name)


def test_routes_and_server_info(sglang_engine):
    t = sglang_engine
    r = t.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    info = t.client.get("/server_info").json()
    assert info["max_lora_rank"] == t.max_lora_rank
    assert info["max_loras_per_batch"] == 8
    assert info["enable_lora"] is True
    assert isinstance(info["lora_target_modules"], list)
    models = t.client.get("/v1/models").json()["data"]
    assert models[0]["id"] == t.model and models[0]["parent"] is None
