"""Router fixtures: a module-wide fleet of real reference engines behind real agents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.launch import Launcher
from tests.fleets import Fleet


@pytest.fixture(scope="session")
def peft_dir(tiny_model, tmp_path_factory) -> Path:
    from lorafleet.testing import make_peft_adapter

    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("peft") / "adapter", r=8, seed=1)


@pytest.fixture(scope="module")
def fleet(make_fleet, tmp_path_factory) -> Iterator[Fleet]:
    """Two replicas (named ``r<i>-<port>``, 32 adapter slots each) shared by a test module;
    tests use their own alias names and start their own routers (``fleet.start_router``)."""
    with Launcher(tmp_path_factory.mktemp("fleet-logs")) as launcher:
        yield make_fleet(launcher, 2, max_loras=32, replica_ids=True, router=False)
