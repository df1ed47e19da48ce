"""SGLang's ``/generate`` on an engine that does not serve it: a streamed token-id completion.

The request becomes a streamed ``/v1/completions`` (streamed so that an abort can end it and
still answer what was generated) and the engine's events are gathered into SGLang's answer: the
same tokens, text and logprobs, in SGLang's shape. What the engine's completions API cannot
honour is a 400 that names it, never a different answer: which sampling fields an engine honours
is its kind's ``completion_fields`` (``lorafleet.engine_kinds``).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.tagging import tag_doc
from lorafleet.engine_kinds import EngineKindInfo, engine_kind, model_field
from lorafleet.errors import InvalidRequest
from lorafleet.protocol.generation import DEFAULT_MAX_NEW_TOKENS, GenerateItem, GenerateRequest
from lorafleet.protocol.router import TAG_FIELD

__all__ = ["Accumulated", "check_translatable", "completion_body", "prompt_scores", "token_id"]

# Extra fields a translated path ignores without changing the answer (routing and cache hints,
# logging). Any other extra field with a value is refused there.
_HARMLESS = {
    "extra_key",
    "priority",
    "routing_key",
    "session_id",
    "log_metrics",
    "no_logs",
    "custom_labels",
    "cache_salt",
    "conversation_id",
    "routed_dp_rank",
    "data_parallel_rank",
    "received_time",
    "image_data",
    "video_data",
    "audio_data",
    "modalities",
}
# SGLang's name -> the completions field that asks the same, where an engine honours it.
_COMPLETION_FIELDS = {
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_new_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "logit_bias": "logit_bias",
}


def check_translatable(req: GenerateRequest, item: GenerateItem, kind: EngineKindInfo) -> None:
    """Refuse (400) what a completion request on an engine of ``kind`` cannot honour."""
    where = f"on a {kind.name} replica (SGLang's own engine answers it)"
    for k, v in req.extras.items():
        if k in _HARMLESS:
            if k.endswith("_data") and v:
                raise InvalidRequest(f"{k} (multimodal input) is not carried {where}", param=k)
            continue
        if v not in (None, False, 0, "", [], {}):
            raise InvalidRequest(f"{k} is not supported {where}", param=k)
    if item.logprob_start_len < -1:
        raise InvalidRequest(
            "logprob_start_len is -1 or a prompt position", param="logprob_start_len"
        )
    if item.top_logprobs_num and req.return_text_in_logprobs:
        raise InvalidRequest(
            f"top_logprobs_num with return_text_in_logprobs is not supported {where}",
            param="return_text_in_logprobs",
        )
    honoured = {k for k, f in _COMPLETION_FIELDS.items() if f in kind.completion_fields}
    for k, value in item.sampling_params.beyond(honoured):
        raise InvalidRequest(
            f"sampling_params.{k}={value!r} is not supported {where}",
            param=f"sampling_params.{k}",
        )


def completion_body(
    req: GenerateRequest, item: GenerateItem, route: Route, replica: Replica
) -> dict[str, Any]:
    """The streamed token-id completion that asks what ``item`` asks (checked first)."""
    kind = engine_kind(replica.kind)
    check_translatable(req, item, kind)
    sp = item.sampling_params
    body: dict[str, Any] = {
        "model": model_field(replica.kind, replica.base_model, route.engine_name),
        "prompt": item.input_ids if item.input_ids is not None else item.text,
        "max_tokens": DEFAULT_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens,
        "temperature": 1.0 if sp.temperature is None else sp.temperature,
        "top_p": 1.0 if sp.top_p is None else sp.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if sp.stop is not None:
        body["stop"] = sp.stop
    if sp.ignore_eos:
        body["ignore_eos"] = True
    if sp.sampling_seed is not None:
        body["seed"] = sp.sampling_seed
    for k, field in _COMPLETION_FIELDS.items():
        value = getattr(sp, k)
        if value is not None and field in kind.completion_fields:
            body[field] = value
    # Always the sampled token's logprob: every streamed token then comes with its id, even
    # one whose text is not whole yet.
    body["logprobs"] = item.top_logprobs_num if item.return_logprob else 0
    if not (item.return_logprob and req.return_text_in_logprobs):
        body["return_tokens_as_token_ids"] = True
    return body


def score_body(body: dict[str, Any], item: GenerateItem) -> dict[str, Any]:
    """The completion that echoes the prompt with its logprobs (one token generated and
    dropped): how the prompt's logprobs are asked of a completions engine."""
    return {
        "model": body["model"],
        "prompt": body["prompt"],
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": item.top_logprobs_num,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }


def prompt_scores(out: dict, item: GenerateItem) -> tuple[list, list]:
    """The prompt's logprobs from ``logprob_start_len`` on, as SGLang lists them, from the echo
    answer ``out``; the first listed position has no logprob, as in SGLang's answer. Raises
    ``KeyError``/``TypeError``/``ValueError`` for an answer not in that shape."""
    top = item.top_logprobs_num
    choice = out["choices"][0]
    lp = choice["logprobs"]
    n = len(item.input_ids) if item.input_ids is not None else out["usage"]["prompt_tokens"]
    tokens, values = lp["tokens"][:n], lp["token_logprobs"][:n]
    tops = (lp.get("top_logprobs") or [None] * n)[:n]
    start = item.logprob_start_len
    ids = [token_id(t) for t in tokens]
    logprobs = [[values[k], ids[k], None] for k in range(start, len(ids))]
    tops_out: list = []
    for k in range(start, len(ids)):
        d = tops[k]
        alts = sorted(((v, token_id(t)) for t, v in (d or {}).items()), key=lambda x: -x[0])
        tops_out.append([[v, t, None] for v, t in alts[:top]] if d else None)
    if logprobs:
        logprobs[0][0] = None
        if tops_out:
            tops_out[0] = None
    return logprobs, tops_out


class Accumulated:
    """A completion stream gathered into SGLang's answer."""

    def __init__(self, item: GenerateItem, text_in_logprobs: bool) -> None:
        self.item = item
        self.text_in_logprobs = text_in_logprobs
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[list[Any]] = []
        self.top: list[list[list[Any]] | None] = []
        self.finish: dict | None = None
        self.prompt_tokens: int | None = None
        self.input_logprobs: list = []
        self.input_top: list = []
        self._sent = -1

    def feed(self, ev: bytes) -> bytes | None:
        """Take one SSE event; the event itself if it is the engine's error."""
        ev = ev.strip()
        if not ev.startswith(b"data:"):
            return None
        data = ev[5:].strip()
        if data == b"[DONE]" or not data:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        if "error" in doc:
            return data
        usage = doc.get("usage")
        if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
            self.prompt_tokens = usage["prompt_tokens"]
        for c in doc.get("choices") or []:
            if c.get("prompt_token_ids") and self.prompt_tokens is None:
                self.prompt_tokens = len(c["prompt_token_ids"])
            self.text += c.get("text") or ""
            ids = c.get("token_ids") or []
            self.ids.extend(ids)
            lp = c.get("logprobs")
            if lp and self.item.return_logprob:
                self._logprobs(lp, ids)
            if c.get("finish_reason") is not None:
                self.finish = self._finish(c["finish_reason"], c.get("stop_reason"))
        return None

    def _logprobs(self, lp: dict, ids: list[int]) -> None:
        tokens = lp.get("tokens") or []
        values = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or [None] * len(tokens)
        for k, tok in enumerate(tokens):
            tid = token_id(tok)
            if tid is None:  # text tokens (return_text_in_logprobs): the ids come beside
                tid = ids[k] if k < len(ids) else -1
            text = tok if self.text_in_logprobs else None
            self.logprobs.append([values[k], tid, text])
            n = self.item.top_logprobs_num
            if n > 0:
                alts = sorted(
                    ((v, token_id(t)) for t, v in (tops[k] or {}).items()),
                    key=lambda x: -x[0],
                )[:n]
                self.top.append([[v, t, None] for v, t in alts])

    def _finish(self, reason: str, stop_reason: Any) -> dict:
        if reason == "length":
            return {"type": "length", "length": len(self.ids)}
        if reason == "abort":
            return {"type": "abort", "message": "aborted by the engine"}
        if stop_reason is None:
            return {"type": "stop", "matched": self.ids[-1] if self.ids else None}
        return {"type": "stop", "matched": stop_reason}

    def changed(self) -> bool:
        n = len(self.ids)
        if n == self._sent:
            return False
        self._sent = n
        return True

    def answer(self, route: Route, replica: Replica, started: float, *, final: bool) -> dict:
        item = self.item
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = len(item.input_ids) if item.input_ids is not None else 0
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": self.finish if final else None,
            "prompt_tokens": prompt,
            "weight_version": "default" if route.adapter is None else str(route.version),
            "num_retractions": 0,
        }
        if item.return_logprob:
            meta["input_token_logprobs"] = self.input_logprobs
            meta["output_token_logprobs"] = list(self.logprobs)
            meta["output_token_logprobs_length"] = len(self.logprobs)
            if item.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self.input_top
                meta["output_top_logprobs"] = list(self.top)
        n = len(self.ids)
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = n
        meta["cached_tokens"] = 0
        if final:
            meta["weight_versions"] = [{"version": meta["weight_version"], "start": 0, "end": n}]
        meta["cached_tokens_details"] = None
        meta["dp_rank"] = None
        if final:
            meta["e2e_latency"] = time.perf_counter() - started
        meta["response_sent_to_client_ts"] = time.time()
        return {
            "text": self.text,
            "output_ids": list(self.ids),
            "meta_info": meta,
            TAG_FIELD: tag_doc(route, replica),
        }


def token_id(tok: str) -> int | None:
    """The id in vLLM's ``return_tokens_as_token_ids`` name for a token (``token_id:<id>``)."""
    if isinstance(tok, str) and tok.startswith("token_id:"):
        with contextlib.suppress(ValueError):
            return int(tok[9:])
    return None
