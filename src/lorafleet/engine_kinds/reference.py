"""The embedded CPU reference engine (``lorafleet engine``): it imitates vLLM's API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafleet.engine_kinds import EngineKindInfo


def _backend(url: str, max_lora_rank: int | None, max_adapters: int | None, _: Mapping[str, Any]):
    from lorafleet.agent.backends.reference import ReferenceBackend

    return ReferenceBackend(url, max_lora_rank=max_lora_rank, max_adapters=max_adapters)


def _rules():
    from lorafleet.rules.reference import REFERENCE

    return REFERENCE


def _spec():
    from lorafleet.launch.specs import ReferenceEngineSpec

    return ReferenceEngineSpec


KIND = EngineKindInfo(
    name="reference",
    title="lorafleet's reference engine",
    backend=_backend,
    rules=_rules,
    launch_spec=_spec,
    embedded=True,
)
