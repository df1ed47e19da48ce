"""Engine backends: one small interface (``EngineBackend``), one module per engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafleet.agent.backends.base import (
    AdapterMissing,
    EngineBackend,
    EngineProbe,
    EngineRejected,
    EngineUnavailable,
)
from lorafleet.agent.backends.reference import ReferenceBackend
from lorafleet.agent.backends.sglang import SGLangBackend
from lorafleet.agent.backends.vllm import VLLMBackend
from lorafleet.engine_kinds import engine_kind

__all__ = [
    "AdapterMissing",
    "EngineBackend",
    "EngineProbe",
    "EngineRejected",
    "EngineUnavailable",
    "ReferenceBackend",
    "SGLangBackend",
    "VLLMBackend",
    "make_backend",
]


def make_backend(
    kind: str,
    url: str,
    *,
    max_lora_rank: int | None = None,
    max_adapters: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> EngineBackend:
    """The backend for ``kind`` (``lorafleet.engine_kinds``); ``options``: that kind's own
    agent flags by key. Raises ``ValueError`` for an unknown kind."""
    return engine_kind(kind).make_backend(
        url, max_lora_rank=max_lora_rank, max_adapters=max_adapters, options=options
    )
