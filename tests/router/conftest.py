"""Router fixtures: a module-wide fleet of real reference engines behind real agents."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.router.rfleet import Procs, Server, start_agent, start_reference_engine


@dataclass
class Member:
    replica_id: str
    engine: Server
    agent: Server


@pytest.fixture(scope="session")
def peft_dir(tiny_model, tmp_path_factory) -> Path:
    from lorafleet.testing import make_peft_adapter

    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("peft") / "adapter", r=8, seed=1)


def make_fleet(procs: Procs, tiny_model: Path, root: Path, n: int) -> list[Member]:
    out = []
    for i in range(n):
        eng = start_reference_engine(procs, tiny_model, max_loras=32)
        rid = f"r{i}-{eng.port}"
        agent = start_agent(procs, eng, root / f"agent{i}", extra=["--replica-id", rid])
        out.append(Member(rid, eng, agent))
    return out


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory) -> list[Member]:
    """Two replicas shared by a test module; tests use their own alias names."""
    procs = Procs(tmp_path_factory.mktemp("fleet-logs"))
    try:
        yield make_fleet(procs, tiny_model, tmp_path_factory.mktemp("fleet"), 2)
    finally:
        procs.stop_all()
