"""Request bodies the reference engine accepts, in vLLM's and SGLang's shapes (pydantic only).

Like vLLM's ``OpenAIBaseModel``, every model accepts unknown fields: clients send extras (``n``,
``user``, ``extra_body`` keys) and an engine that rejects them would be stricter than the real ones.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerateRequest",
    "LoadLoRAAdapterRequest",
    "SGLangLoadLoRAAdapterRequest",
    "SGLangUnloadLoRAAdapterRequest",
    "SamplingParams",
    "StreamOptions",
    "UnloadLoRAAdapterRequest",
]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class StreamOptions(_Open):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Open):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # vLLM's int64 bounds
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    ignore_eos: bool | None = False  # vLLM's extra sampling parameter
    # SGLang's OpenAI routes also take the adapter as ``lora_path`` in the body.
    lora_path: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``; ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprob tokens as "token:<id>"


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; rendered with the tokenizer's chat template."""

    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Open):
    """vLLM's ``POST /v1/load_lora_adapter`` body (fields optional so the check is vLLM's)."""

    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Open):
    lora_name: str | None = None
    lora_int_id: int | None = None


class SGLangLoadLoRAAdapterRequest(_Open):
    """SGLang's ``POST /load_lora_adapter``; ``upsert`` is the Miles fork's extension."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    upsert: bool = False


class SGLangUnloadLoRAAdapterRequest(_Open):
    lora_name: str


class SamplingParams(_Open):
    """The subset of SGLang's ``sampling_params`` the reference engine honours."""

    max_new_tokens: int | None = Field(default=128, ge=0)
    temperature: float | None = Field(default=1.0, ge=0)
    top_p: float | None = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)


class GenerateRequest(_Open):
    """SGLang's native ``POST /generate`` (``GenerateReqInput``), single prompt only."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    lora_path: str | None = None
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = None
