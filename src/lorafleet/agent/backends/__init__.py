"""Engine backends: one small interface (``EngineBackend``), one module per engine."""

from __future__ import annotations

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
    sglang_upsert: bool = False,
) -> EngineBackend:
    """The backend for ``kind`` (vllm, sglang, reference)."""
    if kind == "vllm":
        return VLLMBackend(url, max_lora_rank=max_lora_rank, max_adapters=max_adapters)
    if kind == "reference":
        return ReferenceBackend(url, max_lora_rank=max_lora_rank, max_adapters=max_adapters)
    if kind == "sglang":
        return SGLangBackend(
            url, upsert=sglang_upsert, max_lora_rank=max_lora_rank, max_adapters=max_adapters
        )
    raise ValueError(f"unknown engine kind {kind!r}")
