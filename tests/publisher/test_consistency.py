"""Promise 1 and 3 under load: 40 atomic publications while ~50 req/s hit the alias.

Zero requests may fail, every response's version must be the one active at its arrival (or the
one published while it waited), and no response may be produced by two versions. The checker is
shown to catch violations in tests/router (synthetic traces and a deliberately broken router).

``LORAFLEET_CONSISTENCY_PUBLICATIONS=1000`` runs a longer sweep (each publication takes about a
second under this load on 2 cores; 40 in each mode already cross many flips mid-request).
"""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.protocol.router import AliasTable
from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, wait_until_async
from lorafleet.testing.consistency import check, generate_load

pytestmark = pytest.mark.timeout(600)

PUBLICATIONS = int(os.environ.get("LORAFLEET_CONSISTENCY_PUBLICATIONS", "40"))


async def _routed(router_url: str, name: str) -> float:
    """Requests for ``name`` the router has answered (its metrics)."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(router_url + "/metrics")).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "lorafleet_router_requests"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("adapter") == name
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_publications_under_load_are_consistent(launcher, make_fleet, tiny_model, tmp_path, stream):
    fleet = make_fleet(launcher, 2)
    adapters = [
        make_peft_adapter(tiny_model, tmp_path / f"a{i}", r=8, seed=50 + i) for i in range(2)
    ]
    stop = threading.Event()
    published: list[int] = []
    errors: list[BaseException] = []

    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        pub.publish(str(adapters[0]), name="cons")

        def publish_loop() -> None:
            try:
                for i in range(PUBLICATIONS):
                    published.append(pub.publish(str(adapters[i % 2]), name="cons").version)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
            finally:
                stop.set()

        async def run():
            load = asyncio.create_task(
                generate_load(
                    fleet.router.url,
                    "cons",
                    rate=50,
                    duration_s=300,
                    stream=stream,
                    stop=stop,
                    max_tokens=2,
                )
            )

            # The load is running (the router has answered some of it) before the first flip.
            async def under_way() -> bool:
                if await _routed(fleet.router.url, "cons") >= 5:
                    return True
                assert not load.done(), "the load ended before it reached the router"
                return False

            await wait_until_async(under_way, timeout=120, message="the load reached the router")
            worker = threading.Thread(target=publish_loop)
            worker.start()
            observations = await load
            worker.join()
            return observations

        observations = asyncio.run(run())

    assert not errors, errors
    assert published == list(range(2, PUBLICATIONS + 2))
    r = httpx.get(
        f"{fleet.router.url}/v1/control/aliases",
        headers={"Authorization": f"Bearer {fleet.token}"},
        timeout=10,
    )
    log = AliasTable.model_validate(r.json()).log
    assert [e.version for e in log if e.name == "cons"] == list(range(1, PUBLICATIONS + 2))
    served = {o.version for o in observations}
    assert len(observations) > 100 and len(served) > 10, (len(observations), len(served))
    violations = check(observations, log, "cons")
    assert violations == [], violations[:10]
    # after all that, nothing is left behind: one version held, no staging anywhere
    assert fleet.staging_bytes() == [0, 0]
    for i in range(2):
        assert {(a["version"], a["state"]) for a in fleet.adapters(i)} == {
            (PUBLICATIONS + 1, "active")
        }
