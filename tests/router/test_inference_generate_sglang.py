"""vLLM's native ``/inference/v1/generate`` (SkyRL's generation route) through the router on a
real SGLang 0.5.23 replica, which has no such route: the router translates it to a token-id
completion and answers in vLLM's native shape, with the adapter applied (PEFT's merged output).
"""

from __future__ import annotations

import secrets

import httpx
import pytest

from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, merged_greedy_ids, start_agent, start_router

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]
PROMPT = "The quick brown fox"


def test_inference_generate_on_real_sglang(sglang_server, launcher, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    token = secrets.token_urlsafe(12)
    agent = start_agent(launcher, sglang_server, tmp_path / "agent", kind="sglang", token=token)
    router = start_router(launcher, [agent], tmp_path / "router", token=token, health_interval=0.2)
    name = "skyrl-native-sg"  # SGLang remembers every name it loaded: no other test uses it
    adapter = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=77)
    ids = AutoTokenizer.from_pretrained(str(tiny_model))(PROMPT).input_ids
    want = merged_greedy_ids(tiny_model, adapter, PROMPT, 8)
    with Publisher([agent.url], router=router.url, token=token) as pub:
        result = pub.publish(str(adapter), name=name)
    try:
        body = {
            "model": name,
            "token_ids": ids,
            "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0},
        }
        r = httpx.post(f"{router.url}/inference/v1/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert choice["token_ids"] == want, out  # the adapter's tokens, not the base model's
        assert choice["finish_reason"] in ("length", "stop")
        content = choice["logprobs"]["content"]
        assert [c["token_id"] for c in content] == want
        assert all(isinstance(c["logprob"], float) and c["logprob"] <= 0 for c in content)
        assert out["output_mode"] == "tokens" and out["model"] == name
        assert out["lorafleet"]["version"] == result.version
    finally:
        httpx.post(
            f"{agent.url}/v1/adapters/unload",
            json={"name": name, "version": result.version},
            headers={"Authorization": f"Bearer {token}"},
            timeout=120,
        )
