"""The front's wire protocol: the control calls of a single vLLM server, as trainers send them.

The front (``lorafleet front``) answers one vLLM server's API over a whole fleet::

    GET  /health, /v1/models, /server_info?config_format=json, /get_world_size, /is_paused
    POST /pause?mode=keep, /resume                               acknowledged (no-op)
    POST /v1/load_lora_adapter, /load_lora_adapter                LoadLoRAAdapterRequest
    POST /v1/unload_lora_adapter, /unload_lora_adapter            UnloadLoRAAdapterRequest
    POST /v1/completions, /v1/chat/completions                    forwarded to the router

Field names are vLLM's (``lora_name``, ``lora_path``, ``load_inplace``), modelled once here:
``LoadLoRAAdapterRequest`` and ``UnloadLoRAAdapterRequest`` are the bodies as vLLM itself reads
them (every field optional, so that a missing one is vLLM's own refusal; the reference engine takes
them so), and ``FrontLoadRequest`` / ``FrontUnloadRequest`` the same bodies with the front's bounds.
Unknown fields are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "PAUSE_MODES",
    "FrontLoadRequest",
    "FrontUnloadRequest",
    "LoadLoRAAdapterRequest",
    "UnloadLoRAAdapterRequest",
]

PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body, as vLLM reads it (unknown fields kept)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body, as vLLM reads it (unknown fields kept)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    lora_name: str | None = None
    lora_int_id: int | None = None


class FrontLoadRequest(LoadLoRAAdapterRequest):
    """The load body as the front takes it: a name and a path, bounded; extras ignored."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=200)  # type: ignore[assignment]
    lora_path: str = Field(min_length=1, max_length=4096)  # type: ignore[assignment]
    load_inplace: bool = False
    """Accepted and ignored: every load is a new lorafleet version, whatever the name."""


class FrontUnloadRequest(UnloadLoRAAdapterRequest):
    """The unload body as the front takes it: a bounded name; extras ignored."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=200)  # type: ignore[assignment]
