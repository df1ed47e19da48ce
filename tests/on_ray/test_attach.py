"""``lorafleet.ray.attach_engines``: agents beside engines a trainer already runs on Ray.

The "trainer" here starts two reference engines as its own actors pinned to two nodes, and
reports what SkyRL- or verl-style engine actors know: each engine's URL and node id.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.testing import greedy_completion, merged_greedy_ids

PROMPT = "The quick brown fox"
NAMESPACE = "lf-test-attach"


@pytest.fixture(scope="module")
def trainer_engines(ray_cluster, ray_workdir):
    """Two engines on two distinct nodes, run by the 'trainer' (not by lorafleet)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from lorafleet.engine.spec import ReferenceEngineSpec
    from lorafleet.ray._actors import ServerActor

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])[-2:]
    actors = [
        ray.remote(ServerActor)
        .options(
            num_cpus=0.5,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote(
            ReferenceEngineSpec(model=Path(), name=f"trainer-engine-{i}"),
            f"{ray_workdir}/trainer/{i}",
            tiny_model=True,
        )
        for i, node in enumerate(nodes)
    ]
    infos = ray.get([a.info.remote() for a in actors])
    yield infos
    ray.get([a.stop.remote() for a in actors])
    for a in actors:
        ray.kill(a)


def test_attach_agents_beside_trainer_engines(trainer_engines, ray_workdir, adapters, tiny_model):
    import ray

    from lorafleet.ray import EngineOnRay, attach, attach_engines

    engines = [EngineOnRay(e["url"], e["node_id"], engine="reference") for e in trainer_engines]
    fleet = attach_engines(
        engines,
        namespace=NAMESPACE,
        workdir=ray_workdir,
        api_key="",
        router_args={"health_interval": 0.5},
    )
    try:
        servers = fleet.servers()
        for replica, engine in zip(fleet.replicas, trainer_engines, strict=True):
            assert replica.engine_actor is None  # the trainer's, not lorafleet's
            assert servers[replica.agent_actor]["node_id"] == engine["node_id"]
            assert replica.node_id == engine["node_id"]
            assert replica.engine_url == engine["url"]

        found = attach(NAMESPACE)  # e.g. from the trainer's driver: no URL list
        with found.publisher() as pub:
            res = pub.publish(str(adapters["a"]), name="policy")
        assert res.version == 1
        expected = merged_greedy_ids(tiny_model, adapters["a"], PROMPT, 8)
        for _ in range(4):
            status, ids, body = greedy_completion(found.router_url, "policy", PROMPT, 8)
            assert status == 200, body
            assert (ids, body["lorafleet"]["version"]) == (expected, 1)
    finally:
        fleet.shutdown()
    # The agents and the router are gone, the namespace is free, the engines still run.
    with pytest.raises(LookupError):
        attach(NAMESPACE)
    for e in trainer_engines:
        status, _, _ = greedy_completion(e["url"], "tiny", PROMPT, 2)
        assert status == 200
    assert ray.is_initialized()
