"""TRL 1.16's own ``VLLMClient`` (unmodified, from the package) against the front over 2 replicas.

The sync sequence TRL's AsyncGRPO runs (``_sync_weight_lora``), then rollouts shaped exactly as
its rollout worker sends them (``_generate_one_turn``): token-id prompts, ``return_token_ids``,
``logprobs: 0``, a seed. Outputs must equal the merged adapter's greedy continuation.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lorafleet.testing import make_peft_adapter, merged_greedy_ids

trl_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
VLLMClient = trl_client.VLLMClient

PROMPT = "The quick brown fox"
MAX_TOKENS = 8


def rollout(url: str, model: str, prompt_ids: list[int]) -> dict:
    """One request as TRL's rollout worker sends it, at temperature 0 (greedy)."""
    payload = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": random.getrandbits(63),
    }
    r = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def rollouts(url: str, model: str, prompt_ids: list[int], n: int = 6) -> list[dict]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: rollout(url, model, prompt_ids), range(n)))


def test_trl_sync_sequence_over_two_replicas(front_fleet, tiny_model):
    from accelerate import PartialState
    from transformers import AutoTokenizer

    PartialState()  # TRL's client logs through accelerate, whose trainer has set this up
    front = front_fleet(allow_unauthenticated_control=True)  # TRL sends no token
    lora_dir = front.shared / "trl-lora"
    a1 = make_peft_adapter(tiny_model, lora_dir / "trl-policy-v1", seed=1)
    a2 = make_peft_adapter(tiny_model, lora_dir / "trl-policy-v2", seed=2)
    prompt_ids = AutoTokenizer.from_pretrained(str(tiny_model))(PROMPT).input_ids
    want1 = merged_greedy_ids(tiny_model, a1, PROMPT, MAX_TOKENS)
    want2 = merged_greedy_ids(tiny_model, a2, PROMPT, MAX_TOKENS)
    base = merged_greedy_ids(tiny_model, None, PROMPT, MAX_TOKENS)
    assert want1 != base and want2 != base and want1 != want2

    client = VLLMClient(front.url, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_max_model_len() > 0
    info = client.get_server_info()
    assert info["parallel_config"]["data_parallel_size"] == 1
    assert info["lora_config"]["max_lora_rank"] == 64
    assert info["lora_config"]["max_loras"] == 3  # keep_versions (2) + 1
    assert client.get_dtype().startswith("torch.")
    assert client.get_world_size() == 1

    # TRL's own decision on adapter sync, from what the front reported.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_model)),
        LoraConfig(r=8, target_modules=["q_proj", "v_proj"]),
    )
    args = AsyncGRPOConfig(
        output_dir=str(front.shared / "out"),
        max_staleness=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    assert select_adapter_sync(info, model, args) is True

    # Step 1: what _sync_weight_lora does.
    client.pause()
    client.load_lora_adapter("trl-policy-v1", str(a1))
    client.resume()
    out = rollouts(front.url, "trl-policy-v1", prompt_ids)
    assert {o["model"] for o in out} == {"trl-policy-v1"}
    assert {o["lorafleet"]["version"] for o in out} == {1}
    assert len({o["lorafleet"]["replica"] for o in out}) == 2  # both replicas served
    for o in out:
        choice = o["choices"][0]
        assert choice["token_ids"] == want1
        assert len(choice["logprobs"]["token_logprobs"]) == MAX_TOKENS

    # Step 2: v2 loads; v1 stays routable (the window) until the trainer unloads it.
    client.pause()
    client.load_lora_adapter("trl-policy-v2", str(a2))
    client.resume()
    out2 = rollouts(front.url, "trl-policy-v2", prompt_ids)
    assert {tuple(o["choices"][0]["token_ids"]) for o in out2} == {tuple(want2)}
    assert len({o["lorafleet"]["replica"] for o in out2}) == 2
    assert rollout(front.url, "trl-policy-v1", prompt_ids)["choices"][0]["token_ids"] == want1
    ids = [m["id"] for m in httpx.get(f"{front.url}/v1/models").json()["data"]]
    assert ids[1:] == ["trl-policy-v2", "trl-policy-v1"]

    client.unload_lora_adapter("trl-policy-v1")
    r = httpx.post(
        f"{front.url}/v1/completions",
        json={"model": "trl-policy-v1", "prompt": prompt_ids, "max_tokens": 2},
    )
    assert r.status_code == 404, r.text
    ids = [m["id"] for m in httpx.get(f"{front.url}/v1/models").json()["data"]]
    assert ids[1:] == ["trl-policy-v2"]
    # The newest version cannot be unloaded (nothing would serve the name); TRL ignores it.
    r = httpx.post(f"{front.url}/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v2"})
    assert r.status_code == 409, r.text

    # Loading an older version again is a precise conflict, not a silent rollback.
    r = httpx.post(
        f"{front.url}/v1/load_lora_adapter",
        json={"lora_name": "trl-policy-v1", "lora_path": str(a1), "load_inplace": False},
    )
    assert (r.status_code, r.json()["error"]["code"]) == (409, "version_conflict"), r.text

    # Streaming keeps the trainer's name and lorafleet's tag.
    with httpx.stream(
        "POST",
        f"{front.url}/v1/completions",
        json={"model": "trl-policy-v2", "prompt": PROMPT, "max_tokens": 4, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(e.get("model") == "trl-policy-v2" for e in events if "model" in e)
    assert any(e.get("lorafleet", {}).get("version") == 2 for e in events)

    # Chat, plain and streamed, under the pinned trainer name.
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(
        f"{front.url}/v1/chat/completions",
        json={"model": "trl-policy-v2", "messages": msgs, "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "trl-policy-v2" and r.json()["lorafleet"]["version"] == 2
    r = httpx.post(
        f"{front.url}/v1/chat/completions",
        json={"model": "trl-policy-v2", "messages": msgs, "max_tokens": 3, "stream": True},
        timeout=60,
    )
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert chunks and all(c["model"] == "trl-policy-v2" for c in chunks)
    assert chunks[-1]["lorafleet"]["version"] == 2

    # The base model's name passes through.
    base_id = httpx.get(f"{front.url}/v1/models").json()["data"][0]["id"]
    assert rollout(front.url, base_id, prompt_ids)["choices"][0]["token_ids"] == base
