"""Every generation body lorafleet speaks, modelled once (pydantic only, no I/O): OpenAI's
completions and chat completions (as vLLM takes them), SGLang's native ``/generate``, vLLM's
``/inference/v1/generate`` (SkyRL's) and lorafleet's token-id ``/generate``.

One validation rule per field. The router's data plane, the reference engine, the agent's SGLang
backend and the fronts import these; what an engine kind honours beyond OpenAI's own fields is
its kind's business (``lorafleet.engine_kinds``: ``completion_fields``), and a field a path
cannot honour is refused with a 400 naming it (``SamplingParams.beyond``, ``OPENAI_UNHONOURED``).

SGLang's shapes follow SGLang 0.5.23 (``sglang/srt/managers/io_struct.py`` ``GenerateReqInput``,
``sglang/srt/sampling/sampling_params.py``): a request names its prompt by ``text`` or
``input_ids`` (one, or a batch), with per-item lists allowed for ``sampling_params``, ``rid``,
``return_logprob``, ``logprob_start_len``, ``top_logprobs_num`` and ``lora_path``; a string
``rid`` for a batch becomes ``<rid>_<i>``. In lorafleet ``lora_path`` is an adapter name,
``name@vN`` or ``<name>-v<N>``, resolved as ``model`` is on the OpenAI routes.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_BATCH",
    "MAX_N",
    "MAX_TOP_LOGPROBS",
    "OPENAI_UNHONOURED",
    "SGLANG_DEFAULTS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "GenerateItem",
    "GenerateRequest",
    "InferenceGenerateRequest",
    "SamplingParams",
    "StreamOptions",
    "TokenGenerateRequest",
    "TokenIds",
    "is_native_generate",
    "keeps_every_token",
    "openai_beyond",
]

TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
"""A token-id prompt: non-empty, non-negative ints (booleans are not ints here)."""
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
"""vLLM's and SGLang's seed bounds."""
MAX_N = 128
"""The most samples one prompt may ask for (``n``)."""


class _Open(BaseModel):
    # As vLLM's OpenAIBaseModel: unknown fields are accepted (clients send extras); the ones an
    # engine would honour and this one cannot are refused by name (OPENAI_UNHONOURED).
    model_config = ConfigDict(extra="allow", protected_namespaces=())


# --- OpenAI (vLLM's shapes) ---------------------------------------------------------------------


class StreamOptions(_Open):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Open):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    """vLLM's: keep the k likeliest tokens; 0 or -1 keeps every token."""
    n: int = Field(default=1, ge=1, le=MAX_N)
    """Samples per prompt (GRPO asks for several): choices ``prompt * n + j``."""
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    ignore_eos: bool | None = False  # vLLM's extra sampling parameter
    # vLLM's: logprobs name each token "token_id:<id>" (AReaL reads the id back from it).
    return_tokens_as_token_ids: bool | None = False
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    """vLLM's: each prompt token's logprob and the prompt's top k there (-1: every token)."""
    # SGLang's OpenAI routes also take the adapter as ``lora_path`` in the body.
    lora_path: str | None = None


class CompletionRequest(_SamplingFields):
    """OpenAI's ``POST /v1/completions``; ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = False


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """OpenAI's ``POST /v1/chat/completions``; rendered with the tokenizer's chat template."""

    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True


OPENAI_UNHONOURED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "logit_bias": (None, {}),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "response_format": (None,),
    "suffix": (None, ""),
}
"""vLLM's completion fields an engine that is not vLLM may not honour, each with the values that
ask nothing of it (so a client that sends the default is not refused)."""


# --- SGLang's /generate -------------------------------------------------------------------------

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens`` (OpenAI's ``max_tokens`` defaults to 16)."""
MAX_BATCH = 4096
MAX_TOP_LOGPROBS = 1024

Ids = list[int]
OptStr = str | None

SGLANG_DEFAULTS: dict[str, tuple[Any, ...] | None] = {
    "stop_regex": None,
    "top_k": (None, -1, 1 << 30),
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_new_tokens": (None, 0),
    "n": (None, 1),
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_token_ids": (None, []),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "no_stop_trim": (None, False),
    "stream_interval": None,
    "logit_bias": (None, {}),
    "custom_params": None,
    "beam_width": (None, 0, 1),
    "watermark": None,
    "choice": (None, []),
}
"""SGLang's sampling parameters beyond the ones every engine honours (max_new_tokens,
temperature, top_p, stop, ignore_eos, sampling_seed), each with the values that ask nothing of an
engine (None: only absent)."""


def keeps_every_token(top_k: object) -> bool:
    """A top_k no vocabulary reaches samples from all of it, as no top_k does (AReaL sends 1e8)."""
    return isinstance(top_k, int) and top_k >= 1 << 24


def openai_beyond(doc: dict[str, Any], honoured: Collection[str] = ()) -> list[tuple[str, Any]]:
    """The fields of ``OPENAI_UNHONOURED`` in a completions body ``doc``, outside
    ``honoured``, whose value asks something of the engine, as ``(name, value)``."""
    return [
        (k, doc[k])
        for k, allowed in OPENAI_UNHONOURED.items()
        if k in doc and k not in honoured and doc[k] not in allowed
    ]


def is_native_generate(body: dict) -> bool:
    """SGLang's shape (a ``text`` or ``input_ids`` prompt), not SkyRL's (``model`` +
    ``token_ids``), which the router's ``/generate`` has always answered."""
    if "text" in body or "input_ids" in body:
        return True
    return "token_ids" not in body and "model" not in body


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params`` (unknown keys are refused, as SGLang's contract does).

    Every field is optional: an absent one is SGLang's default. An engine that is not SGLang
    honours the common ones and, of ``SGLANG_DEFAULTS``, those its kind names; ``beyond`` lists
    the rest that ask something."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_new_tokens: int | None = Field(default=None, ge=0)
    n: int | None = Field(default=None, ge=1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: int | None = Field(default=None, ge=1)
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    custom_params: Any = None
    beam_width: int | None = None
    watermark: dict[str, Any] | None = None
    choice: list[str] | None = None

    def beyond(self, honoured: Collection[str] = ()) -> list[tuple[str, Any]]:
        """The fields of ``SGLANG_DEFAULTS`` outside ``honoured`` whose value asks something of
        the engine, as ``(name, value)``: what a path that honours only ``honoured`` refuses."""
        out = []
        for k, allowed in SGLANG_DEFAULTS.items():
            value = getattr(self, k)
            if k in honoured or (k == "top_k" and keeps_every_token(value)):
                continue
            if not (value is None if allowed is None else value in allowed):
                out.append((k, value))
        return out


class GenerateItem(BaseModel):
    """One prompt of a (possibly batched) request, with its own parameters."""

    model_config = ConfigDict(extra="forbid")

    index: int
    text: str | None = None
    input_ids: Ids | None = None
    sampling_params: SamplingParams
    rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    lora_path: str | None = None


def _per_item(value: Any, n: int, what: str, batched: bool) -> list[Any]:
    """``value`` for each of ``n`` items: a list must have one entry per item."""
    if batched and isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for a batch of {n} prompts")
        return value
    return [value] * n


class GenerateRequest(BaseModel):
    """SGLang's ``POST /generate`` body (``GenerateReqInput``), as far as the router reads it.

    Unknown fields are kept (SGLang's contract ignores unknown keys) and passed to an SGLang
    replica as they came; ``lorafleet.router.native`` refuses the ones it cannot honour."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = Field(default=None)
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    lora_path: OptStr | list[OptStr] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if self.text is None and self.input_ids is None:
            # SGLang's words (a body with both is answered from input_ids, as SGLang does).
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if self.input_ids == [] or self.text == []:
            raise ValueError("the prompt cannot be empty")
        n = self.batch_size
        if n is not None and not 1 <= n <= MAX_BATCH:
            raise ValueError(f"a batch holds 1 to {MAX_BATCH} prompts, not {n}")
        for k in ("top_logprobs_num",):
            v = getattr(self, k)
            for x in v if isinstance(v, list) else [v]:
                if x is not None and not 0 <= x <= MAX_TOP_LOGPROBS:
                    raise ValueError(f"{k} must be 0 to {MAX_TOP_LOGPROBS}, not {x}")
        self.items()  # per-item lists of the right length
        return self

    @property
    def batch_size(self) -> int | None:
        """None for a single prompt, else how many prompts."""
        if self.input_ids is not None:
            return len(self.input_ids) if isinstance(self.input_ids[0], list) else None
        return len(self.text) if isinstance(self.text, list) else None

    @property
    def extras(self) -> dict[str, Any]:
        """The fields the router does not read (passed to SGLang replicas as they came)."""
        return dict(self.__pydantic_extra__ or {})

    def items(self) -> list[GenerateItem]:
        """One ``GenerateItem`` per prompt (raises ``ValueError`` for mismatched lists)."""
        n = self.batch_size
        batched = n is not None
        count = n or 1
        # input_ids win over text, as in SGLang's tokenizer manager.
        if self.input_ids is not None:
            ids_list = self.input_ids if batched else [self.input_ids]
            prompts: list[tuple[str | None, Ids | None]] = [(None, x) for x in ids_list]  # type: ignore[misc]
        else:
            texts = self.text if batched else [self.text]
            prompts = [(t, None) for t in texts]  # type: ignore[union-attr]
        for _, ids in prompts:
            if ids is not None and not ids:
                raise ValueError("input_ids cannot be empty")
        if isinstance(self.rid, list):
            if not batched or len(self.rid) != count:
                raise ValueError(f"rid has {len(self.rid)} entries for {count} prompt(s)")
            rids: list[str | None] = list(self.rid)
        elif self.rid is not None and batched:
            rids = [f"{self.rid}_{i}" for i in range(count)]
        else:
            rids = [self.rid] * count
        sps = _per_item(self.sampling_params, count, "sampling_params", batched)
        if isinstance(self.sampling_params, list) and not batched:
            raise ValueError("sampling_params is a list, but there is one prompt")
        lps = _per_item(self.return_logprob, count, "return_logprob", batched)
        starts = _per_item(self.logprob_start_len, count, "logprob_start_len", batched)
        tops = _per_item(self.top_logprobs_num, count, "top_logprobs_num", batched)
        loras = _per_item(self.lora_path, count, "lora_path", batched)
        if isinstance(self.lora_path, list) and not batched:
            raise ValueError("lora_path is a list, but there is one prompt")
        return [
            GenerateItem(
                index=i,
                text=prompts[i][0],
                input_ids=prompts[i][1],
                sampling_params=sps[i] or SamplingParams(),
                rid=rids[i] or uuid.uuid4().hex,
                return_logprob=bool(lps[i]),
                logprob_start_len=-1 if starts[i] is None else starts[i],
                top_logprobs_num=tops[i] or 0,
                lora_path=loras[i],
            )
            for i in range(count)
        ]


# --- vLLM's /inference/v1/generate and lorafleet's /generate ------------------------------------


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
