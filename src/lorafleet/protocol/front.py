"""The front's wire protocol: the control calls of a single vLLM server, as trainers send them.

The front (``lorafleet front``) answers one vLLM server's API over a whole fleet::

    GET  /health, /v1/models, /server_info?config_format=json, /get_world_size, /is_paused
    POST /pause?mode=keep, /resume                               acknowledged (no-op)
    POST /v1/load_lora_adapter, /load_lora_adapter                LoadLoRAAdapterRequest
    POST /v1/unload_lora_adapter, /unload_lora_adapter            UnloadLoRAAdapterRequest
    POST /v1/completions, /v1/chat/completions                    forwarded to the router

Field names are vLLM's (``lora_name``, ``lora_path``, ``load_inplace``). Unknown fields are
ignored, as vLLM ignores them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "PAUSE_MODES",
    "LoadLoRAAdapterRequest",
    "PauseMode",
    "UnloadLoRAAdapterRequest",
]

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoadLoRAAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False
    """Accepted and ignored: every load is a new lorafleet version, whatever the name."""


class UnloadLoRAAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_int_id: int | None = None
