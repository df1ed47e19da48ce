"""``AgentConfig``: every agent setting, declared once (flags, specs and fleet-file keys derive)."""

from __future__ import annotations

from dataclasses import dataclass, field

import click

from lorafleet._service import DEFAULT_JSON_LIMIT
from lorafleet._settings import setting
from lorafleet.agent.limits import UploadLimits
from lorafleet.protocol.agent import EngineKind

__all__ = ["AgentConfig", "AgentSettings"]


@dataclass(kw_only=True)
class AgentSettings:
    """The agent's own settings: each is a flag of ``lorafleet agent``, a field of ``AgentSpec``
    (written as flags when off its default) and a key of the fleet file's ``[replica.agent]``."""

    served_model_name: str | None = setting(
        None, flag="--served-model-name", help="Default: discovered from the engine."
    )
    shared_fs_allow: list[str] = setting(
        flag="--shared-fs-allow",
        multiple=True,
        type=click.Path(),
        default_factory=list,
        help="Directory /v1/adapters/register may read from (repeatable).",
    )
    max_lora_rank: int | None = setting(
        None, flag="--max-lora-rank", type=int, help="Override the engine's limit."
    )
    max_adapters: int | None = setting(
        None, flag="--max-adapters", type=int, help="Override the engine's limit."
    )


@dataclass(kw_only=True)
class AgentConfig(AgentSettings):
    """A running agent's whole configuration: its settings, and what a launcher gives it."""

    engine: EngineKind
    engine_url: str
    data_dir: str
    token: str | None
    replica_id: str
    limits: UploadLimits = field(default_factory=UploadLimits)
    engine_options: dict[str, bool] = field(default_factory=dict)
    """The engine kind's own flags by key (``lorafleet.engine_kinds``: sglang_upsert)."""
    reconcile_interval: float = 0.5
    json_limit: int = DEFAULT_JSON_LIMIT
