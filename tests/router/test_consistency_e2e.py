"""The consistency checker against real cutovers: clean with the real router, and it catches a
router with a deliberate time-of-check/time-of-use bug (``tests.doubles.broken_router``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from lorafleet.protocol.router import AliasTable
from lorafleet.testing.consistency import check, generate_load
from tests.doubles.broken_router import start_broken_router
from tests.router.helpers import ctl, install_sync, set_alias, wait_healthy

pytestmark = pytest.mark.timeout(300)


def run_cutovers(router, fleet, versions, engine_names, stream=False):
    """~50 req/s for ``name`` while the alias flips through ``versions``; (observations, log)."""
    ids = [m.replica_id for m in fleet.replicas]

    async def go():
        load = asyncio.create_task(
            generate_load(router.url, "cons", rate=50, duration_s=3.0, stream=stream)
        )
        async with httpx.AsyncClient(timeout=10) as c:
            for v in versions:
                await asyncio.sleep(0.5)
                body = {"version": v, "engine_name": engine_names[v], "replicas": ids}
                r = await c.put(
                    router.url + "/v1/control/aliases/cons", json=body, headers=ctl(router)
                )
                assert r.status_code == 200, r.text
            table = await c.get(router.url + "/v1/control/aliases", headers=ctl(router))
        return await load, AliasTable.model_validate(table.json()).log

    return asyncio.run(go())


@pytest.fixture(scope="module")
def cons_versions(fleet, peft_dir):
    return {v: install_sync(fleet.agents, peft_dir, "cons", v) for v in (1, 2, 3, 4)}


@pytest.mark.parametrize("stream", [False, True])
def test_real_cutovers_are_consistent(launcher, fleet, cons_versions, stream):
    router = fleet.start_router(launcher)
    wait_healthy(router, 2)
    set_alias(router, "cons", 1, cons_versions[1], [m.replica_id for m in fleet.replicas])
    observations, log = run_cutovers(router, fleet, [2, 3, 4], cons_versions, stream=stream)
    assert len(observations) == 150
    assert {o.version for o in observations} >= {1, 4}
    assert check(observations, log, "cons") == []


def test_checker_catches_a_broken_cutover(launcher, fleet, cons_versions):
    router = start_broken_router(
        launcher,
        fleet.agents,
        token=fleet.token,
        resolve_at_forward=0.2,
        health_interval=fleet.health_interval,
    )
    wait_healthy(router, 2)
    set_alias(router, "cons", 1, cons_versions[1], [m.replica_id for m in fleet.replicas])
    observations, log = run_cutovers(router, fleet, [2, 3, 4], cons_versions)
    kinds = {v.kind for v in check(observations, log, "cons")}
    assert "mixed_versions" in kinds  # tagged with the arrival version, served by the next one
