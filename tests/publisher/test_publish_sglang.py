"""The Publisher end to end on a real SGLang 0.5.23 replica (agent --engine sglang + router).

What issue 11 found: real SGLang answers a bare adapter name with the base model and a 200, so a
router that addressed it vLLM's way tagged base-model output with the adapter's version. Here
every routed answer (completions, chat, SkyRL's ``/generate``) must be the adapter's: the output
SGLang gives for ``<base>:<engine name>`` directly, which is PEFT's merged output and not the
base model's; and the publication's probe must say ``applied``.
"""

from __future__ import annotations

import secrets

import httpx
import pytest

from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, merged_greedy_ids, start_agent, start_router

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": PROMPT}]


def _completion(url: str, **body) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(url: str, **body) -> dict:
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, **body}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _skyrl_generate(url: str, model: str, ids: list[int]) -> dict:
    body = {
        "model": model,
        "token_ids": ids,
        "sampling_params": {"max_tokens": 8, "temperature": 0},
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(model_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(text).input_ids


def test_publish_v1_v2_to_real_sglang(sglang_server, launcher, tiny_model, tmp_path):
    token = secrets.token_urlsafe(12)
    agent = start_agent(launcher, sglang_server, tmp_path / "agent", kind="sglang", token=token)
    router = start_router(launcher, [agent], tmp_path / "router", token=token, health_interval=0.2)
    info = httpx.get(f"{agent.url}/v1/info", timeout=10).json()
    caps = info["capabilities"]
    # Read from SGLang's /server_info, not from the agent's flags.
    assert (caps["kind"], caps["max_lora_rank"], caps["max_loras_per_batch"]) == ("sglang", 16, 8)
    assert info["base_model"] == "tiny"

    name = "policy"  # SGLang remembers every name it loaded: no other test uses this one
    served = sglang_server.url
    base = _completion(served, model="tiny")["choices"][0]["text"]
    base_chat = _chat(served, model="tiny")["choices"][0]["message"]["content"]
    adapters = [make_peft_adapter(tiny_model, tmp_path / f"v{i}", r=8, seed=60 + i) for i in (1, 2)]
    headers = {"Authorization": f"Bearer {token}"}
    try:
        with Publisher(
            [agent.url], router=router.url, token=token, retire_in_background=False
        ) as pub:
            for version, adapter in enumerate(adapters, start=1):
                result = pub.publish(str(adapter), name=name)
                assert result.version == version
                assert [t.application for t in result.replicas.values()] == ["applied"]
                direct = f"tiny:{name}@v{version}"

                # Completions: the adapter's output, PEFT's, not the base model's; tagged v.
                want = _completion(served, model=direct)["choices"][0]["text"]
                assert want != base
                routed = _completion(router.url, model=name)
                assert routed["lorafleet"]["version"] == version
                assert routed["model"] == name
                assert routed["choices"][0]["text"] == want
                ids = merged_greedy_ids(tiny_model, adapter, PROMPT, 8)
                got = _completion(router.url, model=name, return_token_ids=True)
                assert got["choices"][0]["token_ids"] == ids, got  # PEFT merged, greedy

                # Chat.
                want_chat = _chat(served, model=direct)["choices"][0]["message"]["content"]
                assert want_chat != base_chat
                routed = _chat(router.url, model=name)
                assert routed["lorafleet"]["version"] == version
                assert routed["choices"][0]["message"]["content"] == want_chat

                # SkyRL's /generate through the router: token ids in, the adapter's text out.
                prompt_ids = _tokens(tiny_model, PROMPT)
                routed = _skyrl_generate(router.url, name, prompt_ids)
                assert routed["choices"][0]["text"] == want, routed
                assert routed["choices"][0]["token_ids"] == ids, routed
                assert routed["lorafleet"]["version"] == version

                # The agent's verdict, asked again: applied.
                r = httpx.post(
                    f"{agent.url}/v1/adapters/verify",
                    json={"name": name, "version": version},
                    headers=headers,
                    timeout=60,
                )
                assert r.status_code == 200, r.text
                assert r.json()["application"] == "applied"
            assert result.retired_versions == [1]
    finally:
        for version in (1, 2):
            httpx.post(
                f"{served}/unload_lora_adapter",
                json={"lora_name": f"{name}@v{version}"},
                timeout=30,
            )
