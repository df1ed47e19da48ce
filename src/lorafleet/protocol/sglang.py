"""SGLang's native API beyond generation: ``/workers``, ``/abort_request`` (pydantic only, no
I/O). Its ``POST /generate`` bodies are generation bodies: ``lorafleet.protocol.generation``.

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

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AbortRequest", "WorkerInfo", "WorkerList"]


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
