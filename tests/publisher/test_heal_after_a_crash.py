"""An engine SIGKILLed in the middle of a publication: nothing needs a person afterwards.

Seen before: the publish raised (good) but said v2 "was rolled back" although the rollback failed
on the dead replica; its agent kept a staged v2 after the engine came back; and the trainer's next
publication of new weights met 409 adapter_conflict there at every try.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from lorafleet.errors import PublishError
from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_adapter, wait_until

pytestmark = pytest.mark.timeout(600)


def _blobs(agent) -> set[str]:
    return {p.name for p in (agent.spec.data_dir / "blobs" / "sha256").iterdir()}


def _digests(adapter_dir: Path) -> set[str]:
    return {
        hashlib.sha256(p.read_bytes()).hexdigest()
        for p in adapter_dir.iterdir()
        if p.name in ("adapter_config.json", "adapter_model.safetensors")
    }


def test_engine_killed_mid_publish_heals_and_the_next_publish_succeeds(
    launcher, make_fleet, tiny_model, tmp_path
):
    fleet = make_fleet(launcher, 2)
    a, b, c = (make_peft_adapter(tiny_model, tmp_path / n, r=8, seed=40 + i)
               for i, n in enumerate("abc"))  # fmt: skip
    killed = []

    def kill_engine_0(replica: str, sent: int, total: int) -> None:
        if not killed and sent:  # v2's bytes are on their way: the engine dies now
            killed.append(replica)
            fleet.engines[0].proc.kill()

    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        pub.publish(str(a), name="policy")
    with (
        Publisher(
            fleet.agent_urls, router=fleet.router.url, token=fleet.token, on_progress=kill_engine_0
        ) as pub,
        pytest.raises(PublishError) as failed,
    ):
        pub.publish(str(b), name="policy")
    err = failed.value
    dead = fleet.agents[0]
    dead_id = next(k for k in err.failures if k != "router")
    # The truth, per replica: v1 keeps serving, and v2 stays on the dead one until it is back.
    assert "v1 keeps serving" in str(err) and f"except on {dead_id}" in str(err), str(err)
    assert "retiring" in err.failures[dead_id] or "could not be reached" in err.failures[dead_id]

    # The engine comes back (a supervisor restarts it on its port); no person touches anything.
    launcher.restart(fleet.engines[0])  # same spec, same port
    # v1 reinstalled, v2 retired by the agent itself
    wait_until(
        lambda: {(x["version"], x["state"]) for x in fleet.adapters(0)} == {(1, "active")},
        timeout=60,
        message=f"only v1 active on {dead_id} after the engine came back",
    )
    only_b = _digests(b) - _digests(a) - _digests(c)  # adapter_config.json is the same in all
    assert only_b and not only_b & _blobs(dead)  # no byte of the failed v2

    # The trainer's next publication (new weights) just works, under a new number: the failed
    # v2's bytes reached an engine as policy@v2, so its number is burnt (issue 26: a version
    # number is never reused for other weights).
    with Publisher(fleet.agent_urls, router=fleet.router.url, token=fleet.token) as pub:
        result = pub.publish(str(c), name="policy")
    assert result.version == 3
    for i, agent in enumerate(fleet.agents):
        assert {(x["version"], x["digest"]) for x in fleet.adapters(i)} == {(3, result.digest)}
        assert not only_b & _blobs(agent)
        assert not any(os.scandir(agent.spec.data_dir / "staging"))
