"""The retention window, in-process: which versions stay routable, pins, sessions, staleness."""

from __future__ import annotations

import pytest

from lorafleet.dataplane.balancer import Balancer
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.pipeline import Pipeline
from lorafleet.errors import StaleVersion, VersionNotRoutable
from lorafleet.router.table import AliasStore


def _publish(store: AliasStore, name: str, versions, **window) -> None:
    for v in versions:
        store.set_alias(name, v, f"{name}@v{v}", [f"r{v % 2}"], **window)


def test_window_keeps_the_newest_k_and_survives_a_restart(tmp_path):
    store = AliasStore(tmp_path)
    _publish(store, "p", [1, 2, 3, 4, 5], keep_versions=3)
    e = store.aliases["p"]
    assert e.version == 5 and [v.version for v in e.window()] == [5, 4, 3]
    assert [v.engine_name for v in e.window()] == ["p@v5", "p@v4", "p@v3"]
    assert AliasStore(tmp_path).aliases["p"] == e
    # narrowing the window drops the oldest at the next flip
    store.set_alias("p", 6, "p@v6", ["r0"], keep_versions=1)
    assert [v.version for v in store.aliases["p"].window()] == [6]


def _proxy(store: AliasStore) -> Pipeline:
    return Pipeline(store, Balancer([]), RouterMetrics(), session=None)  # type: ignore[arg-type]


def test_pins_address_exactly_one_version_of_the_window():
    store = AliasStore()
    _publish(store, "p", [1, 2, 3, 4], keep_versions=3)
    proxy = _proxy(store)
    assert proxy.resolve("p").version == 4
    for v in (4, 3, 2):
        route = proxy.resolve(f"p@v{v}")
        assert (route.adapter, route.version, route.engine_name) == ("p", v, f"p@v{v}")
        assert route.alias == f"p@v{v}" and route.lag == 4 - v  # the client sees its own model
    with pytest.raises(VersionNotRoutable, match=r"routable: v4, v3, v2"):
        proxy.resolve("p@v1")
    with pytest.raises(VersionNotRoutable):
        proxy.resolve("p@v9")


def test_sessions_keep_their_version_until_it_leaves_the_window():
    store = AliasStore()
    _publish(store, "p", [1], keep_versions=2)
    proxy = _proxy(store)
    assert proxy.resolve("p", "episode-1").version == 1
    _publish(store, "p", [2], keep_versions=2)
    assert proxy.resolve("p", "episode-1").version == 1  # the episode stays on v1
    assert proxy.resolve("p", "episode-2").version == 2  # a new one starts on the newest
    assert proxy.resolve("p").version == 2
    _publish(store, "p", [3], keep_versions=2)
    with pytest.raises(VersionNotRoutable, match="session 'episode-1'"):
        proxy.resolve("p", "episode-1")  # never silently switched to v3
    assert proxy.resolve("p", "episode-2").version == 2
    proxy.balancer.sessions.forget("episode-1")  # /finish_session
    assert proxy.resolve("p", "episode-1").version == 3


def test_follow_sessions_always_get_the_newest():
    store = AliasStore()
    _publish(store, "p", [1], keep_versions=2, sessions="follow")
    proxy = _proxy(store)
    assert proxy.resolve("p", "s").version == 1
    _publish(store, "p", [2], keep_versions=2, sessions="follow")
    assert proxy.resolve("p", "s").version == 2


def test_staleness_bound_refuses_old_pins_and_sessions():
    store = AliasStore()
    _publish(store, "p", [1, 2, 3], keep_versions=3, max_staleness=1)
    proxy = _proxy(store)
    assert proxy.resolve("p@v2").version == 2
    with pytest.raises(StaleVersion, match="max_staleness 1"):
        proxy.resolve("p@v1")  # in the window, but too old
    store2 = AliasStore()
    _publish(store2, "q", [1], keep_versions=3, max_staleness=1)
    proxy2 = _proxy(store2)
    proxy2.resolve("q", "s")
    _publish(store2, "q", [2, 3], keep_versions=3, max_staleness=1)
    with pytest.raises(StaleVersion):
        proxy2.resolve("q", "s")


def test_only_a_version_that_left_the_window_can_be_drained():
    import asyncio

    import httpx

    from lorafleet.router.app import RouterConfig, create_app

    router = create_app(RouterConfig(agents=[], control_token="t"))
    _publish(router.store, "p", [1, 2, 3], keep_versions=2)

    async def drain(v: int) -> httpx.Response:
        transport = httpx.ASGITransport(app=router.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as c:
            return await c.post(
                "/v1/control/aliases/p/drain",
                json={"version": v, "timeout_s": 0},
                headers={"Authorization": "Bearer t"},
            )

    refused = asyncio.run(drain(2))
    assert refused.status_code == 409 and "retention window" in refused.json()["error"]["message"]
    drained = asyncio.run(drain(1)).json()
    assert drained == {"name": "p", "version": 1, "inflight": 0, "drained": True}
