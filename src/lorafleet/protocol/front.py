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
AReaL's vLLM server adds (``--dialect vllm``)::

    POST /areal_pause_generation, /areal_continue_generation      AReaL's pause (front.gate)

The SGLang dialect (``--dialect sglang``) answers one SGLang 0.5.23 server's, with its names::

    GET  /health, /health_generate, /model_info, /get_model_info, /server_info, /v1/models
    POST /pause_generation                                        PauseGenerationRequest
    POST /continue_generation                                     ContinueGenerationRequest
    POST /load_lora_adapter                                       SGLangLoadLoRAAdapterRequest
    POST /unload_lora_adapter                                     SGLangUnloadLoRAAdapterRequest
    POST /generate, /v1/completions, /v1/chat/completions         forwarded to the router
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "PAUSE_MODES",
    "SGLANG_PAUSE_MODES",
    "ContinueGenerationRequest",
    "FrontLoadRequest",
    "FrontSGLangLoadRequest",
    "FrontSGLangUnloadRequest",
    "FrontUnloadRequest",
    "LoadLoRAAdapterRequest",
    "PauseGenerationRequest",
    "SGLangLoRAUpdateOutput",
    "SGLangLoadLoRAAdapterRequest",
    "SGLangPauseMode",
    "SGLangUnloadLoRAAdapterRequest",
    "UnloadLoRAAdapterRequest",
]

PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


SGLangPauseMode = Literal["abort", "retract", "in_place"]
SGLANG_PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


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


# -- SGLang's bodies (sglang.srt.managers.io_struct, 0.5.23): its field names and defaults. --------


class PauseGenerationRequest(_Model):
    """``POST /pause_generation``: ``abort`` (SGLang's default) ends what is in flight."""

    mode: SGLangPauseMode = "abort"


class ContinueGenerationRequest(_Model):
    torch_empty_cache: bool = True
    """Accepted and ignored: the front holds no accelerator memory."""


class SGLangLoadLoRAAdapterRequest(_Model):
    """SGLang's ``POST /load_lora_adapter``, as SGLang reads it: what the agent sends an SGLang
    engine and the reference engine's SGLang dialect takes."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None
    upsert: bool = False
    """The Miles fork's extension: replace a registered name (stock SGLang ignores it)."""


class SGLangUnloadLoRAAdapterRequest(_Model):
    lora_name: str
    lora_id: str | None = None


class FrontSGLangLoadRequest(SGLangLoadLoRAAdapterRequest):
    """The SGLang load body as the front takes it: bounded; ``pinned`` and ``upsert`` accepted
    and ignored (the retention window decides what stays loaded; every load is a version)."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=4096)
    lora_id: str | None = Field(default=None, max_length=200)


class FrontSGLangUnloadRequest(SGLangUnloadLoRAAdapterRequest):
    lora_name: str = Field(min_length=1, max_length=200)
    lora_id: str | None = Field(default=None, max_length=200)


class SGLangLoRAUpdateOutput(BaseModel):
    """SGLang's answer to a load or unload (``LoRAUpdateOutput``): what is loaded, name -> path.
    A refusal has ``success: false`` and lorafleet's ``error`` envelope beside it."""

    rid: str | None = None
    http_worker_ipc: str | None = None
    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None
