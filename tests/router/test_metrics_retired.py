"""A router nobody scrapes does not keep series for every version it ever served.

bench/soak.py: the router's RSS grew ~9 KiB per publication at RL cadence, most of it the
request, latency and in-flight series of retired versions, dropped only when ``/metrics`` was
scraped. They are now dropped at every alias change and drain too.
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from lorafleet.router.app import RouterApp, RouterConfig


def test_flips_drop_the_series_of_retired_versions_without_a_scrape():
    router = RouterApp(RouterConfig(agents=["http://127.0.0.1:9"], control_token="t"))
    # As if its agent had answered a health poll: aliases may only name known replicas.
    router.balancer.replicas[0].replica_id = "r0"
    auth = {"Authorization": "Bearer t"}
    with TestClient(router.api) as client:  # no request is routed: only the control plane
        for v in range(1, 51):
            body = {"version": v, "engine_name": f"p@v{v}", "replicas": ["r0"]}
            r = client.put("/v1/control/aliases/p", json=body, headers=auth)
            assert r.status_code == 200, r.text
            # What the proxy does for each request it serves on the new version.
            hist, _ = router.metrics.children("p", v)
            hist.observe(0.01)
            router.metrics.count("p", v, 200)
        assert set(router.metrics._children) == {("p", 50)}
        assert set(router.metrics._counters) == {("p", 50, 200)}
        body = {"version": 51, "engine_name": "p@v51", "replicas": ["r0"], "keep_versions": 2}
        assert client.put("/v1/control/aliases/p", json=body, headers=auth).status_code == 200
        assert set(router.metrics._children) == {("p", 50)}  # still routable: kept
        r = client.post("/v1/control/aliases/p/drain", json={"version": 49}, headers=auth)
        assert r.status_code == 200 and r.json()["drained"], r.text
