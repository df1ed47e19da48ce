"""SGLang 0.5.23, as seen on real servers (docs/engines/sglang.md).

A bare adapter name in ``model`` silently serves the **base model**. The adapter applies for
``model = "<served base name>:<adapter name>"`` (which wins over ``lora_path``), or ``lora_path``
with ``model`` the base name. ``/generate`` reads only ``lora_path``. SGLang re-reads a name's
remembered path after an unload, so in-place loads go through a link the agent repoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafleet.engine_kinds import EngineKindInfo, EngineOption

UPSERT = EngineOption(
    key="sglang_upsert", flag="--sglang-upsert", help="The SGLang server accepts Miles' upsert."
)


def _backend(
    url: str, max_lora_rank: int | None, max_adapters: int | None, options: Mapping[str, Any]
):
    from lorafleet.agent.backends.sglang import SGLangBackend

    return SGLangBackend(
        url,
        upsert=bool(options.get(UPSERT.key, False)),
        max_lora_rank=max_lora_rank,
        max_adapters=max_adapters,
    )


def _rules():
    from lorafleet.rules.sglang import SGLANG

    return SGLANG


def _spec():
    from lorafleet.launch.specs import SGLangSpec

    return SGLangSpec


KIND = EngineKindInfo(
    name="sglang",
    title="SGLang 0.5.23",
    backend=_backend,
    rules=_rules,
    launch_spec=_spec,
    adapter_in_model=lambda base, engine_name: f"{base}:{engine_name}",
    links_in_place=True,
    options=(UPSERT,),
)
