"""The SkyRL dialect's wire protocol: what SkyRL 0.4.0's ``RemoteInferenceClient`` sends to one
inference server, and the remote-upload calls of SkyRL's LoRA-publication pull request.

``lorafleet front --dialect skyrl`` answers (besides the vLLM dialect's routes)::

    POST /skyrl/v1/load_lora_adapter                  SkyRLLoadRequest -> SkyRLLoadResponse
    PUT  /skyrl/v1/lora-adapters/{upload_id}/{file}   raw bytes, UPLOAD_SHA256_HEADER and
                                                      UPLOAD_SIZE_HEADER -> UploadedFile
    DELETE /skyrl/v1/lora-adapters/{upload_id}        -> {"status": "ok"}
    POST /v1/unload_lora_adapter                      UnloadLoRAAdapterRequest (front.py):
                                                      retires the name
    POST /reset_prefix_cache                          ResetPrefixCacheRequest
    POST /collective_rpc                              CollectiveRpcRequest
    POST /inference/v1/generate, /skyrl/v1/generate   vLLM's token-in token-out body, routed
    POST /tokenize, /detokenize                       vLLM's bodies, answered by an engine
    POST /finish_session?session_id=                  ends the session at the router

Unknown fields are ignored, as SkyRL's server ignores them.
"""

from __future__ import annotations

import re
import uuid

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CONFIG_FILENAME",
    "UPLOAD_FILENAMES",
    "UPLOAD_MAX_BYTES",
    "UPLOAD_SHA256_HEADER",
    "UPLOAD_SIZE_HEADER",
    "WEIGHT_FILENAMES",
    "CollectiveRpcRequest",
    "ResetPrefixCacheRequest",
    "SkyRLLoadRequest",
    "SkyRLLoadResponse",
    "UploadedFile",
    "parse_upload_id",
    "parse_upload_sha256",
    "parse_upload_size",
]

UPLOAD_SHA256_HEADER = "X-SkyRL-SHA256"
UPLOAD_SIZE_HEADER = "X-SkyRL-File-Size"
UPLOAD_MAX_BYTES = 128 << 30
"""SkyRL's per-file cap (128 GiB); a front may set a lower one."""
CONFIG_FILENAME = "adapter_config.json"
WEIGHT_FILENAMES: tuple[str, ...] = ("adapter_model.safetensors", "adapter_model.bin")
UPLOAD_FILENAMES: tuple[str, ...] = (CONFIG_FILENAME, *WEIGHT_FILENAMES)
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SkyRLLoadRequest(_Model):
    """``{"lora_name", "lora_path"}``, ``{"lora_name", "upload_id"}`` or ``{"lora_name",
    "in_memory": true}`` (CUDA-IPC staging, which a fleet cannot do: refused by the front)."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str | None = Field(default=None, min_length=1, max_length=4096)
    upload_id: str | None = Field(default=None, min_length=1, max_length=64)
    in_memory: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> SkyRLLoadRequest:
        if self.lora_path is not None and self.upload_id is not None:
            raise ValueError("Provide either lora_path or upload_id.")
        if not self.in_memory and self.lora_path is None and self.upload_id is None:
            raise ValueError("Provide either lora_path or upload_id.")
        return self


class SkyRLLoadResponse(_Model):
    status: str = "ok"
    lora_name: str
    lora_int_id: int
    """lorafleet's version of the name (SkyRL's server answers vLLM's adapter id here)."""
    lorafleet: dict = Field(default_factory=dict)


class UploadedFile(_Model):
    filename: str
    sha256: str


class ResetPrefixCacheRequest(_Model):
    reset_running_requests: bool = False


class CollectiveRpcRequest(_Model):
    method: str = Field(min_length=1, max_length=200)
    kwargs: dict | None = None
    args: list | None = None
    timeout: float | None = None


def parse_upload_id(value: str) -> str:
    """The canonical form of a SkyRL upload id (a UUID). Raises ``ValueError``."""
    try:
        return str(uuid.UUID(value))
    except (ValueError, AttributeError, TypeError):
        raise ValueError("Invalid LoRA upload id.") from None


def parse_upload_sha256(value: str | None) -> str:
    """``X-SkyRL-SHA256``: 64 hex digits, lower-cased. Raises ``ValueError``."""
    if value is None:
        raise ValueError("Missing LoRA upload integrity headers.")
    if not _HEX64.match(value.strip()):
        raise ValueError(f"{UPLOAD_SHA256_HEADER} must be a sha256 hex digest (64 hex digits).")
    return value.strip().lower()


def parse_upload_size(value: str | None) -> int:
    """``X-SkyRL-File-Size``: a decimal byte count (negative values are the caller's 413).
    Raises ``ValueError`` for a missing or non-integer value."""
    if value is None:
        raise ValueError("Missing LoRA upload integrity headers.")
    v = value.strip()
    if not re.fullmatch(r"-?[0-9]{1,20}", v):
        raise ValueError(f"{UPLOAD_SIZE_HEADER} must be an integer byte count.")
    return int(v)
