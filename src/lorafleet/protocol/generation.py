"""Generation bodies lorafleet speaks (pydantic only, no I/O): one rule per field.

Provisional: the token shapes the router's data plane validates. (Extended with every shape.)
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "InferenceGenerateRequest",
    "TokenGenerateRequest",
    "TokenIds",
]

TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
"""A token-id prompt: non-empty, non-negative ints (booleans are not ints here)."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class CompletionRequest(_Open):
    """OpenAI's ``POST /v1/completions``."""

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool | None = False


class ChatCompletionRequest(_Open):
    """OpenAI's ``POST /v1/chat/completions``."""

    model: str | None = None
    messages: list[dict[str, Any]]
    stream: bool | None = False


class InferenceGenerateRequest(_Open):
    """vLLM's native ``POST /inference/v1/generate`` (SkyRL's generation route)."""

    model: str | None = None
    token_ids: TokenIds
    sampling_params: dict[str, Any]
    stream: bool = False


class TokenGenerateRequest(_Open):
    """lorafleet's own ``POST /generate``: a token-id prompt, sampling as for completions."""

    model: str | None = None
    token_ids: TokenIds
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
