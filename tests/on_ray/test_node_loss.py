"""A node lost in the middle of a publication: the publication rolls back, the old version keeps
serving, Ray re-places the replica on a spare node, the router is told its new address, and the
next publication reaches it."""

from __future__ import annotations

import httpx
import pytest

from lorafleet.errors import PublishError
from lorafleet.testing import greedy_completion, merged_greedy_ids, wait_until

PROMPT = "The quick brown fox"
NAMESPACE = "lf-test-node-loss"


def _routed(fleet, model):
    status, ids, body = greedy_completion(fleet.router_url, model, PROMPT, 8)
    assert status == 200, body
    return ids, body["lorafleet"]["version"]


def _router_replicas(fleet) -> dict[str, dict]:
    r = httpx.get(
        f"{fleet.router_url}/v1/control/replicas",
        headers={"Authorization": f"Bearer {fleet.token}"},
        timeout=10,
    )
    r.raise_for_status()
    return {x["agent_url"]: x for x in r.json()["replicas"]}


def _agent_versions(url, token, name):
    r = httpx.get(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    r.raise_for_status()
    return {a["version"] for a in r.json()["adapters"] if a["name"] == name}


def test_node_lost_mid_publication_replica_replaced_and_republished(
    ray_cluster, ray_workdir, adapters, tiny_model, tmp_path
):
    import ray

    from lorafleet.ray import deploy
    from lorafleet.testing import make_peft_adapter

    # Somewhere for the lost node's replica to go (every node holds one replica's bundle at most
    # beside the router), and a node to lose that is neither the head nor this driver's.
    ray_cluster.add_node(**ray_cluster.node_args)
    ray_cluster.wait_for_nodes()
    fleet = deploy(
        2,
        namespace=NAMESPACE,
        workdir=ray_workdir,
        api_key="",
        max_restarts=2,
        router_args={"health_interval": 0.5},
    )
    try:
        keep = {ray.get_runtime_context().get_node_id(), ray_cluster.head_node.node_id}
        v = next(i for i, r in enumerate(fleet.replicas) if r.node_id not in keep)
        lost = next(n for n in ray_cluster.worker_nodes if n.node_id == fleet.replicas[v].node_id)
        old_agent, old_engine = fleet.agent_urls[v], fleet.engine_urls[v]

        with fleet.publisher() as pub:
            v1 = pub.publish(str(adapters["a"]), name="policy").version
        expected_v1 = merged_greedy_ids(tiny_model, adapters["a"], PROMPT, 8)
        fresh = make_peft_adapter(tiny_model, tmp_path / "fresh", r=8, seed=79)
        removed = []

        def lose_node(replica: str, sent: int, total: int) -> None:
            if not removed:  # bytes are moving: the commit is still ahead
                removed.append(replica)
                ray_cluster.remove_node(lost)
                # Called on the publication's event loop: nothing of it moves on until the node
                # is gone, so no step of the lost replica can finish after this point.
                wait_until(
                    lambda: not _answers(old_agent), timeout=60, message="lost agent answers"
                )

        with fleet.publisher(on_progress=lose_node) as pub, pytest.raises(PublishError):
            pub.publish(str(fresh), name="policy", transfer="remote_upload")
        assert removed, "the publication never reported progress"

        # Atomic: v1 keeps serving from the replica that is left.
        for _ in range(4):
            assert _routed(fleet, "policy") == (expected_v1, v1)

        # Ray re-places the replica's placement group; its agent asks its engine actor for the
        # engine's new URL, writes its own into the record and tells the router.
        def replaced() -> bool:
            if fleet.refresh().agent_urls[v] == old_agent:
                return False
            info = ray.get(fleet.agent_actor(v).info.remote(), timeout=10)
            assert info["told"] in (None, "moved"), info["told"]
            return info["told"] == "moved"

        wait_until(replaced, timeout=240, message="replica not re-placed")
        moved = fleet.replicas[v]
        assert moved.node_id != lost.node_id
        assert moved.engine_url != old_engine
        servers = fleet.servers()
        engine, agent = servers[moved.engine_actor], servers[moved.agent_actor]
        assert engine["node_id"] == agent["node_id"] == moved.node_id, "engine and agent split"
        assert engine["url"] == moved.engine_url

        def router_sees_it() -> bool:
            seen = _router_replicas(fleet)
            return old_agent not in seen and seen.get(moved.agent_url, {}).get("healthy", False)

        wait_until(router_sees_it, timeout=60, message="router never polled the new URL")
        # The new node's agent starts empty: the router holds v1 on the other replica only.
        assert _agent_versions(moved.agent_url, fleet.token, "policy") == set()
        for _ in range(4):
            assert _routed(fleet, "policy") == (expected_v1, v1)

        # The next publication reaches the re-placed replica (the publisher reads the record).
        with fleet.publisher() as pub:
            res = pub.publish(str(fresh), name="policy")
        # The failed attempt's number is burnt if its bytes reached the kept replica's engine
        # before the node was lost (issue 26: a number never names two adapters), and given back
        # if the attempt ended before any load.
        v2 = res.version
        assert v2 in (v1 + 1, v1 + 2), v2
        assert set(res.replicas) == {"replica-0", "replica-1"}
        expected_v2 = merged_greedy_ids(tiny_model, fresh, PROMPT, 8)
        for _ in range(6):
            assert _routed(fleet, "policy") == (expected_v2, v2)
        for url in fleet.agent_urls:
            assert _agent_versions(url, fleet.token, "policy") == {v2}
        status = fleet.status()
        assert status.router_healthy and all(r.healthy for r in status.replicas)
    finally:
        fleet.shutdown()


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1.0)
    except httpx.HTTPError:
        return False
    return True
