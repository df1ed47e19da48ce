"""Data-plane copies on Ray: one per node, kept current by the router actor, serving while the
router actor is down (``deploy(copies_per_node=...)``)."""

from __future__ import annotations

import httpx

from lorafleet.testing import wait_until

NAMESPACE = "lf-test-copies"


def _version(url: str) -> tuple[int, int | None]:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "policy", "prompt": "hi", "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    return r.status_code, r.json().get("lorafleet", {}).get("version")


def test_a_copy_per_node_serves_while_the_router_actor_is_down(ray_cluster, ray_workdir, adapters):
    import ray

    from lorafleet.ray import deploy

    fleet = deploy(
        1,
        namespace=NAMESPACE,
        workdir=ray_workdir,
        api_key="",
        max_restarts=2,
        copies_per_node=1,
        router_args={"health_interval": 0.5},
    )
    try:
        nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        servers = fleet.servers()
        assert {servers[name]["node_id"] for name in fleet.dataplane} == nodes
        with fleet.publisher() as publisher:
            v1 = publisher.publish(adapters["a"], name="policy").version
        for url in fleet.dataplane_urls:
            assert _version(url) == (200, v1)
        # The router actor's process dies: Ray restarts it; meanwhile the copies serve.
        router = fleet.actor("lorafleet-router")
        ray.kill(router, no_restart=False)
        for url in fleet.dataplane_urls:
            assert _version(url) == (200, v1)

        def restarted() -> bool:
            try:
                return ray.get(router.info.remote(), timeout=30)["alive"]
            except ray.exceptions.RayError:  # unavailable while Ray restarts it
                return False

        wait_until(
            restarted,
            timeout=180,
            message="the router actor restarted",
        )
        with fleet.publisher() as publisher:
            v2 = publisher.publish(adapters["b"], name="policy").version
        assert v2 > v1
        for url in fleet.dataplane_urls:
            assert _version(url) == (200, v2)
    finally:
        fleet.shutdown()
