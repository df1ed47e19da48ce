"""The application probe refuses an engine that loads an adapter but does not apply it.

The fleet is misconfigured on purpose: the engine behaves as real SGLang 0.5.23 (the reference
engine's ``--dialect sglang``, with vLLM's load routes kept so a vLLM agent can load into it:
``tests.doubles.misaddressed_engine``),
and its agent says ``--engine vllm``. So the router and the probe address an adapter with its
bare name, which SGLang answers with the base model and a 200 (docs/engines/sglang.md). Without
the probe every routed request would be tagged with the new version and served by the base.
"""

from __future__ import annotations

import secrets

import httpx
import pytest

from lorafleet.errors import AdapterNotApplied, PublishError
from lorafleet.publisher import Publisher
from lorafleet.testing import (
    greedy_completion,
    make_peft_adapter,
    start_agent,
    start_router,
)
from tests.doubles.misaddressed_engine import start_misaddressed_engine

pytestmark = pytest.mark.timeout(300)


def test_bare_name_on_sglang_is_not_applied_and_the_cutover_refused(launcher, tiny_model, tmp_path):
    token = secrets.token_urlsafe(12)
    engine = start_misaddressed_engine(launcher, tiny_model, max_lora_rank=16)
    agent = start_agent(launcher, engine, tmp_path / "agent", kind="vllm", token=token)
    router = start_router(launcher, [agent], token=token, health_interval=0.2)
    # A freshly initialised PEFT adapter (B = 0) changes nothing: unverifiable, never refused.
    zero = make_peft_adapter(tiny_model, tmp_path / "zero", r=8, init_lora_weights=True)
    real = make_peft_adapter(tiny_model, tmp_path / "real", r=8, seed=7)
    _, base_ids, _ = greedy_completion(engine.url, "tiny")

    with Publisher([agent.url], router=router.url, token=token) as pub:
        v1 = pub.publish(str(zero), name="policy")
        assert [t.application for t in v1.replicas.values()] == ["unverifiable"]

        with pytest.raises(PublishError) as caught:
            pub.publish(str(real), name="policy")
    (why,) = caught.value.failures.values()
    assert why.startswith(f"502 {AdapterNotApplied.code}:"), why
    assert "does not apply it as addressed" in why, why

    # Rolled back: v2 is gone from agent and engine, and v1 still serves under the alias.
    held = httpx.get(
        f"{agent.url}/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10
    ).json()["adapters"]
    assert [(a["name"], a["version"]) for a in held] == [("policy", v1.version)]
    status, ids, body = greedy_completion(router.url, "policy")
    assert status == 200, body
    assert body["lorafleet"]["version"] == v1.version
    assert ids == base_ids  # v1 is the zero adapter: the base model's output is right

    # Without the probe the same adapter is cut over, and the version tag lies: v3 "serves"
    # the base model's output. The agent's verdict on it is a 502 adapter_not_applied.
    with Publisher([agent.url], router=router.url, token=token, verify=False) as pub:
        v3 = pub.publish(str(real), name="policy")
    assert [t.application for t in v3.replicas.values()] == ["unchecked"]
    status, ids, body = greedy_completion(router.url, "policy")
    assert (status, body["lorafleet"]["version"], ids) == (200, v3.version, base_ids)
    r = httpx.post(
        f"{agent.url}/v1/adapters/verify",
        json={"name": "policy", "version": v3.version},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "adapter_not_applied", r.text
