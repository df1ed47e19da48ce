"""Reference-engine-only behaviour: limits real vLLM does not have, ops routes, concurrency."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.launch import Launcher
from lorafleet.testing import start_reference_engine, wait_until
from tests.engine.helpers import PROMPT, expected


@pytest.fixture
def ref(reference_engine):
    with httpx.Client(base_url=reference_engine.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory, tiny_model):
    """A dedicated engine: max_loras 2, max rank 8, with an API key."""
    with Launcher(tmp_path_factory.mktemp("small-engine")) as launcher:
        engine = start_reference_engine(
            launcher, tiny_model, max_loras=2, max_lora_rank=8, api_key="sekret"
        )
        yield engine.url


def greedy(client: httpx.Client, model: str, prompt: str = PROMPT, **kw) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_engine_info(ref, adapters):
    info = ref.get("/v1/engine_info").json()
    assert info["model"] == "tiny"
    assert info["max_loras"] == 8 and info["max_lora_rank"] == 64
    r = ref.post(
        "/v1/load_lora_adapter", json={"lora_name": "info-a", "lora_path": str(adapters["a"])}
    )
    assert r.status_code == 200
    try:
        assert ref.get("/v1/engine_info").json()["adapters"]["info-a"] == str(adapters["a"])
    finally:
        ref.post("/v1/unload_lora_adapter", json={"lora_name": "info-a"})
    assert "info-a" not in ref.get("/v1/engine_info").json()["adapters"]


def test_max_loras_caps_registration_and_api_key(small_engine, adapters):
    auth = {"Authorization": "Bearer sekret"}
    with httpx.Client(base_url=small_engine, timeout=60) as c:
        assert c.get("/health").status_code == 200  # ops routes stay open
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        c.headers.update(auth)
        for name in ("one", "two"):
            r = c.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters["c"])}
            )
            assert r.status_code == 200, r.text
        r = c.post(
            "/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": str(adapters["c"])}
        )
        assert r.status_code == 503, r.text
        assert "max_loras=2" in r.json()["error"]["message"]
        # In place does not count as a new registration.
        r = c.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "two", "lora_path": str(adapters["c"]), "load_inplace": True},
        )
        assert r.status_code == 200, r.text
        # This engine's max rank is 8: a rank-16 adapter is refused with vLLM's text.
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "two"}).status_code == 200
        r = c.post(
            "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["mlp"])}
        )
        assert r.status_code == 500
        assert "LoRA rank 16 is greater than max_lora_rank 8." in r.json()["error"]["message"]
        assert c.get("/v1/engine_info").json()["adapters"] == {"one": str(adapters["c"])}


def test_deleting_last_adapter_restores_base(small_engine, adapters, tiny_model):
    with httpx.Client(
        base_url=small_engine, timeout=60, headers={"Authorization": "Bearer sekret"}
    ) as c:
        for n in list(c.get("/v1/engine_info").json()["adapters"]):
            c.post("/v1/unload_lora_adapter", json={"lora_name": n})
        base = expected(str(tiny_model), None)
        for _ in range(2):  # the engine goes back to no PEFT at all, twice over
            r = c.post(
                "/v1/load_lora_adapter", json={"lora_name": "solo", "lora_path": str(adapters["c"])}
            )
            assert r.status_code == 200, r.text
            assert greedy(c, "solo") == expected(str(tiny_model), str(adapters["c"]))
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "solo"}).status_code == 200
            assert greedy(c, "tiny") == base


def test_sglang_model_syntax_on_openai_routes(ref, adapters, tiny_model):
    r = ref.post(
        "/v1/load_lora_adapter", json={"lora_name": "colon", "lora_path": str(adapters["b"])}
    )
    assert r.status_code == 200
    try:
        want = expected(str(tiny_model), str(adapters["b"]))
        assert greedy(ref, "tiny:colon") == want
        assert greedy(ref, "tiny", lora_path="colon") == want
        assert (
            ref.post("/v1/completions", json={"model": "tiny:nope", "prompt": "x"}).status_code
            == 404
        )
    finally:
        ref.post("/v1/unload_lora_adapter", json={"lora_name": "colon"})


def _completions_arrived(ref: httpx.Client) -> float:
    """The engine's count of /v1/completions requests (counted on arrival)."""
    for family in text_string_to_metric_families(ref.get("/metrics").text):
        if family.name == "lorafleet_engine_requests":
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("route") == "/v1/completions"
            )
    return 0.0


def test_health_answers_while_generating(ref):
    """Model work runs on a worker thread, so the event loop stays free while it is busy."""
    results: list[httpx.Response] = []

    def long_request() -> None:
        body = {
            "model": "tiny",
            "prompt": "x",
            "max_tokens": 500,
            "temperature": 1.0,
            "seed": 1,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=str(ref.base_url), timeout=120) as c:
            results.append(c.post("/v1/completions", json=body))

    arrived = _completions_arrived(ref)
    threads = [threading.Thread(target=long_request) for _ in range(4)]
    for t in threads:
        t.start()
    # All four are inside the engine (one generating, three queued for the model worker) once
    # it has counted them. Were model work on the event loop, it could not count the last one
    # before the first three had finished.
    wait_until(
        lambda: _completions_arrived(ref) >= arrived + 4 or not all(t.is_alive() for t in threads),
        message="the requests never reached the engine",
    )
    probes_while_all_in_flight = 0
    while all(t.is_alive() for t in threads):
        assert ref.get("/health").status_code == 200
        if all(t.is_alive() for t in threads):
            probes_while_all_in_flight += 1
        time.sleep(0.02)  # paces the probes
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 500 for r in results)
    # Four 500-token requests on one worker: /health is answered again and again before even
    # the first of them is done.
    assert probes_while_all_in_flight >= 3, probes_while_all_in_flight


def _timed_completion(ref: httpx.Client, **body) -> float:
    t0 = time.monotonic()
    r = ref.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_stream_disconnect_stops_generation(ref):
    long = {"max_tokens": 500, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    full = _timed_completion(ref, **long)  # the ruler: this machine, now, 500 tokens
    with ref.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
        for _ in r.iter_lines():
            break
    # The engine has one model worker: had generation continued after the client left, a short
    # request would wait for the rest of the 500 tokens. It is answered long before that.
    after = _timed_completion(ref, max_tokens=2, temperature=0)
    assert after < full / 2, (after, full)


def test_metrics(ref):
    greedy(ref, "tiny")
    text = ref.get("/metrics").text
    assert 'lorafleet_engine_requests_total{model="tiny",route="/v1/completions"}' in text
    assert "lorafleet_engine_generation_tokens_total" in text
    assert "lorafleet_engine_prompt_tokens_total" in text
    assert "lorafleet_engine_adapters_loaded" in text


def test_context_length_is_400(ref):
    r = ref.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 100000})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"


def test_multiple_prompts_give_one_choice_each(ref):
    r = ref.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": ["Hello", "The quick"], "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
