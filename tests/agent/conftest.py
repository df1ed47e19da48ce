"""Agent test fixtures: a real engine, real agent processes, adapters and store snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.agent.spec import AgentSpec
from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.launch import Server
from lorafleet.testing import start_agent, start_reference_engine


@pytest.fixture(scope="session")
def peft_dir(tiny_model, tmp_path_factory) -> Path:
    """A real PEFT adapter (r=8, q/k/v/o, random weights)."""
    from lorafleet.testing import make_peft_adapter

    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("peft") / "a", r=8, seed=1)


@pytest.fixture(scope="session")
def peft_dir2(tiny_model, tmp_path_factory) -> Path:
    from lorafleet.testing import make_peft_adapter

    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("peft") / "b", r=8, seed=2)


@pytest.fixture(scope="session")
def peft_dir_rank32(tiny_model, tmp_path_factory) -> Path:
    from lorafleet.testing import make_peft_adapter

    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("peft") / "r32", r=32, seed=3)


@pytest.fixture(scope="session")
def engine(session_launcher, tiny_model) -> tuple[str, Server[ReferenceEngineSpec]]:
    """(backend kind, server): one reference engine (max rank 16, like the vLLM tier)."""
    return "reference", start_reference_engine(session_launcher, tiny_model, max_lora_rank=16)


@pytest.fixture
def agent_factory(launcher, engine, tmp_path):
    """Start an agent (real process) in front of the session engine; returns a callable."""
    kind, eng = engine
    n = 0

    def start(
        *extra: str, data_dir: Path | None = None, token: str | None = None
    ) -> Server[AgentSpec]:
        nonlocal n
        n += 1
        d = data_dir or tmp_path / f"agent{n}"
        return start_agent(launcher, eng, d, kind=kind, token=token, extra=extra)

    return start


@pytest.fixture
def agent(agent_factory) -> Server[AgentSpec]:
    return agent_factory()
