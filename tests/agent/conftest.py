"""Agent test fixtures: a real engine, real agent processes, adapters and store snapshots."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest


def _root_conftest():
    # tests/conftest.py is loaded by pytest as plain "conftest", a name this file shadows; load
    # its helper functions under a name of their own.
    import importlib.util
    import sys

    name = "lorafleet_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parents[1] / "conftest.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_root = _root_conftest()
Server = _root.Server
start_agent = _root.start_agent
start_reference_engine = _root.start_reference_engine


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
def engine(session_procs, tiny_model) -> tuple[str, Server]:
    """(backend kind, server): one reference engine (max rank 16, like the vLLM tier)."""
    return "reference", start_reference_engine(session_procs, tiny_model, max_lora_rank=16)


@pytest.fixture
def agent_factory(procs, engine, tmp_path):
    """Start an agent (real process) in front of the session engine; returns a callable."""
    kind, eng = engine
    n = 0

    def start(*extra: str, data_dir: Path | None = None, token: str | None = None) -> Server:
        nonlocal n
        n += 1
        d = data_dir or tmp_path / f"agent{n}"
        return start_agent(procs, eng, d, kind=kind, token=token, extra=list(extra))

    return start


@pytest.fixture
def agent(agent_factory) -> Server:
    return agent_factory()


def auth(server: Server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def snapshot(data_dir: Path) -> dict:
    """What the store holds: blob and adapter files (path -> size, sha256), staging bytes."""
    out: dict = {"staging_bytes": 0, "files": {}}
    for sub in ("blobs", "adapters"):
        root = data_dir / sub
        for dirpath, _, files in os.walk(root):
            for f in files:
                p = Path(dirpath) / f
                out["files"][str(p.relative_to(data_dir))] = (
                    p.stat().st_size,
                    hashlib.sha256(p.read_bytes()).hexdigest(),
                )
    for dirpath, _, files in os.walk(data_dir / "staging"):
        for f in files:
            out["staging_bytes"] += (Path(dirpath) / f).stat().st_size
    return out


def completion(url: str, model: str, prompt: str = "The quick brown fox") -> list[int]:
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice.get("token_ids") or choice["text"]
