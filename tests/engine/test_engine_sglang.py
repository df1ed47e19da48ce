"""The SGLang dialect of the reference engine: /load_lora_adapter, /unload_lora_adapter, /generate.

No SGLang runs here (it needs a GPU); the shapes follow SGLang's http_server.py and io_struct.py.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from tests.engine.helpers import PROMPT, expected


@pytest.fixture
def ref(reference_engine):
    with httpx.Client(base_url=reference_engine.url, timeout=60) as c:
        yield c
        # Leave the session engine clean whatever a test did.
        for name in list(c.get("/v1/engine_info").json()["adapters"]):
            if name.startswith("sgl-"):
                c.post("/unload_lora_adapter", json={"lora_name": name})


def sgl_load(c: httpx.Client, name: str, path, **extra) -> httpx.Response:
    return c.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def generate(c: httpx.Client, **body) -> dict:
    body.setdefault("sampling_params", {"max_new_tokens": 8, "temperature": 0})
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_load_unload_body_and_statuses(ref, adapters):
    r = sgl_load(ref, "sgl-a", adapters["a"])
    assert r.status_code == 200
    body = r.json()
    assert body["success"] is True and body["error_message"] is None
    assert body["loaded_adapters"]["sgl-a"] == str(adapters["a"])
    dup = sgl_load(ref, "sgl-a", adapters["b"])
    assert dup.status_code == 400
    assert dup.json()["success"] is False
    assert dup.json()["error_message"] == (
        "Failed to load LoRA adapter sgl-a because it is already loaded"
    )
    r = ref.post("/unload_lora_adapter", json={"lora_name": "sgl-a"})
    assert r.status_code == 200 and r.json()["success"] is True
    assert "sgl-a" not in r.json()["loaded_adapters"]
    r = ref.post("/unload_lora_adapter", json={"lora_name": "sgl-a"})
    assert r.status_code == 400
    assert r.json()["error_message"] == "LoRA with name sgl-a does not exist"


def test_load_bad_path_is_400(ref, tmp_path):
    r = sgl_load(ref, "sgl-bad", tmp_path / "nothing")
    assert r.status_code == 400
    assert r.json()["success"] is False and "sgl-bad" in r.json()["error_message"]


def test_upsert_replaces_in_place(ref, adapters, tiny_model):
    assert sgl_load(ref, "sgl-up", adapters["a"]).status_code == 200
    before = generate(ref, text=PROMPT, lora_path="sgl-up")["text"]
    assert before == expected(str(tiny_model), str(adapters["a"]))
    r = sgl_load(ref, "sgl-up", adapters["b"], upsert=True)
    assert r.status_code == 200, r.text
    assert r.json()["loaded_adapters"]["sgl-up"] == str(adapters["b"])
    after = generate(ref, text=PROMPT, lora_path="sgl-up")["text"]
    assert after == expected(str(tiny_model), str(adapters["b"]))


def test_generate_shape_base_and_input_ids(ref, tiny_model):
    out = generate(ref, text=PROMPT)
    assert out["text"] == expected(str(tiny_model), None)
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("length", "stop")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_model))(PROMPT).input_ids
    by_ids = generate(ref, input_ids=ids)
    assert by_ids["output_ids"] == out["output_ids"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)


def test_generate_length_finish_reason(ref):
    out = generate(
        ref, text="x", sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_generate_unknown_lora_is_400(ref):
    r = ref.post("/generate", json={"text": "x", "lora_path": "sgl-nope"})
    assert r.status_code == 400
    assert "not loaded: sgl-nope" in r.json()["error"]["message"]


def test_generate_stream_is_cumulative(ref, adapters, tiny_model):
    assert sgl_load(ref, "sgl-s", adapters["c"]).status_code == 200
    body = {
        "text": PROMPT,
        "lora_path": "sgl-s",
        "stream": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }
    with ref.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    frames = raw.split("\n\n")[:-1]
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert chunks[-1]["text"] == expected(str(tiny_model), str(adapters["c"]))
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_get_model_info(ref, tiny_model):
    info = ref.get("/get_model_info").json()
    assert info["is_generation"] is True
    assert info["model_path"] == str(tiny_model.resolve())
