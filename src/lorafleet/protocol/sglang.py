"""SGLang's native API at the router: ``POST /generate`` bodies and answers, ``/workers``,
``/abort_request`` (pydantic only, no I/O). The router (``lorafleet.router.native``) and the
fronts that forward SGLang's ``/generate`` import these.

What is copied from SGLang 0.5.23 (``sglang/srt/managers/io_struct.py`` ``GenerateReqInput``,
``sglang/api/v1/api_types.py`` ``GenerateResponse``, ``http_server.py``):

- a request names its prompt by ``text`` or ``input_ids`` (one, or a batch: a list of strings or
  a list of id lists), with per-item lists allowed for ``sampling_params``, ``rid``,
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num`` and ``lora_path``; a string
  ``rid`` for a batch becomes ``<rid>_<i>``;
- an answer is ``{"text", "output_ids", "meta_info"}`` (a list of them for a batch), with
  ``meta_info`` holding ``id``, ``finish_reason`` (``{"type": "stop", "matched"}``, ``{"type":
  "length", "length"}`` or ``{"type": "abort", "message"}``), ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``weight_version``, ``e2e_latency`` and, with
  ``return_logprob``, ``output_token_logprobs`` (``[logprob, token_id, text|null]`` per token),
  ``input_token_logprobs`` and the top-logprob lists;
- a stream is server-sent events of cumulative answers, then ``data: [DONE]``.

What lorafleet adds: ``lora_path`` is a lorafleet adapter name, ``name@vN`` or ``<name>-v<N>``
(``lorafleet.protocol.trainer_names``), resolved as ``model`` is on the OpenAI routes;
``meta_info.weight_version`` is the answering adapter's version (a string, as SGLang's is), and
each answer carries the ``lorafleet`` version tag.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_BATCH",
    "MAX_TOP_LOGPROBS",
    "AbortRequest",
    "GenerateItem",
    "GenerateRequest",
    "SamplingParams",
    "WorkerInfo",
    "WorkerList",
    "is_native_generate",
]

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens`` (OpenAI's ``max_tokens`` defaults to 16)."""
MAX_BATCH = 4096
MAX_TOP_LOGPROBS = 1024

Ids = list[int]
OptStr = str | None


def is_native_generate(body: dict) -> bool:
    """SGLang's shape (a ``text`` or ``input_ids`` prompt), not SkyRL's (``model`` +
    ``token_ids``), which the router's ``/generate`` has always answered."""
    if "text" in body or "input_ids" in body:
        return True
    return "token_ids" not in body and "model" not in body


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params`` (unknown keys are refused, as SGLang's contract does).

    Every field is optional: an absent one is SGLang's default. Which of them an engine that
    is not SGLang honours is the router's business (``lorafleet.router.native``)."""

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


class AbortRequest(BaseModel):
    """SGLang's ``POST /abort_request``: one request by ``rid``, or every one."""

    model_config = ConfigDict(extra="ignore")

    rid: str = Field(default="", max_length=4096)
    abort_all: bool = False


class WorkerInfo(BaseModel):
    """One replica as sglang-router's ``GET /workers`` lists a worker.

    ``url`` is the router's own per-replica address (``<router>/workers/<id>``): a client that
    aborts on each worker (``POST <url>/abort_request``) and polls its load (``GET
    <url>/v1/loads``), as Miles and slime do, reaches every engine kind through the router."""

    id: str
    url: str
    model_id: str | None
    worker_type: Literal["regular"] = "regular"
    connection_mode: Literal["http"] = "http"
    is_healthy: bool
    load: int
    engine_kind: str


class WorkerList(BaseModel):
    workers: list[WorkerInfo]
    total: int
    stats: dict[str, int]
