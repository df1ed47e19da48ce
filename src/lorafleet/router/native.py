"""SGLang's native API at the router: ``POST /generate`` (text or ``input_ids``), the worker
list and ``/abort_request``, for every engine kind behind the router.

On an SGLang replica a request goes to the engine's own ``/generate`` with ``lora_path`` set to
the version's engine name, and the engine's answer comes back as it was, with
``meta_info.weight_version`` set to the lorafleet version that produced it and a ``lorafleet``
version tag. On a vLLM or reference replica it becomes a streamed token-id ``/v1/completions``
request (streamed so that an abort can end it and still answer what was generated), and the
router builds SGLang's answer from the engine's: the same tokens, text and logprobs, in SGLang's
shape. What a translated path cannot honour is a 400 that says so, never a different answer.

``lora_path`` is resolved at arrival as ``model`` is on the OpenAI routes (``Proxy.resolve``):
a lorafleet name (its newest version, or the one a session started on), ``name@vN``, or a
trainer's ``<name>-v<N>`` (``lorafleet.protocol.trainer_names``); absent or null is the base
model. A batch is split into its prompts, each routed on its own and answered in order.

Abort (``POST /abort_request``, ``POST /workers/{id}/abort_request``): SGLang replicas get
SGLang's own call; elsewhere the router ends the upstream requests it holds for that ``rid`` (or
all of them), and each answers with what it had generated and finish reason ``abort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
from pydantic import ValidationError

from lorafleet._service import send_error
from lorafleet.engine_kinds import model_field
from lorafleet.errors import (
    EngineUnavailable,
    InvalidRequest,
    NoReplica,
    ServiceError,
    StreamInterrupted,
)
from lorafleet.protocol.errors import error_body
from lorafleet.protocol.router import TAG_FIELD
from lorafleet.protocol.sglang import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerateItem,
    GenerateRequest,
    WorkerInfo,
    WorkerList,
)
from lorafleet.protocol.trainer_names import NameMap, TrainerName
from lorafleet.router.balancer import Replica

if TYPE_CHECKING:
    from lorafleet.router.addressing import Route
    from lorafleet.router.proxy import Proxy

__all__ = ["Native", "worker_list"]

_NAMES = NameMap()
_DONE = b"data: [DONE]\n\n"
_JSON = {"Content-Type": "application/json"}
# Fields of GenerateReqInput that no replica of a lorafleet fleet can honour: engine-side state
# that another replica (or another version) does not share, or inputs the router cannot check.
_NEVER = {
    "input_embeds": "input_embeds (prompt embeddings)",
    "session_params": "session_params (SGLang's engine-side sessions; use X-Session-ID)",
    "lora_id": "lora_id (SGLang's internal adapter id; name the adapter in lora_path)",
}
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
# sampling_params -> the completions field that honours it, per engine kind. ``None``: only the
# default value (SGLang's) is accepted there.
_DEFAULTS: dict[str, Any] = {
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
# What vLLM's completions API takes for SGLang's sampling parameters.
_VLLM_FIELDS = {
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


def worker_list(replicas: list[Replica], base_url: str) -> WorkerList:
    """``GET /workers``: every replica, with the router's own per-replica URL."""
    base = base_url.rstrip("/")
    workers = [
        WorkerInfo(
            id=_rid(r),
            url=f"{base}/workers/{quote(_rid(r), safe='')}",
            model_id=r.base_model,
            is_healthy=r.routable,
            load=r.inflight,
            engine_kind=r.kind,
        )
        for r in replicas
    ]
    n = len(workers)
    return WorkerList(
        workers=workers,
        total=n,
        stats={"prefill_count": 0, "decode_count": 0, "regular_count": n},
    )


def _rid(r: Replica) -> str:
    return r.replica_id or r.agent_url


@dataclass(eq=False)
class _Live:
    """A translated request in flight: what an abort sets."""

    rid: str
    replica: Replica
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Answer:
    status: int
    body: Any
    """A JSON-ready answer (200), or the engine's error bytes."""
    replica: Replica | None = None
    ctype: str = "application/json"


class Native:
    """The SGLang-native routes of one ``Proxy``."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.live: dict[str, set[_Live]] = {}

    # --- /generate ------------------------------------------------------------------------------

    async def generate(self, send, receive, body: dict, session: str | None) -> int:
        """Answer one SGLang ``/generate`` body; the status sent."""
        proxy = self.proxy
        t0 = time.perf_counter()
        try:
            req = _parse(body)
            items = req.items()
            if req.stream and req.batch_size is not None:
                raise InvalidRequest(
                    "a batched stream is not supported by lorafleet's router: stream one "
                    "prompt per request",
                    param="stream",
                )
            routes = [self._resolve(item, session) for item in items]
            cands = [self._candidates(route) for route in routes]
        except ServiceError as exc:
            await send_error(send, exc)
            return exc.status
        keys = [(r.adapter, r.version) for r in routes]
        for key in keys:  # same tick as resolve(): no await in between
            proxy.balancer.begin(key)
        status = 0
        try:
            if req.stream:
                run = self._stream(send, req, items[0], routes[0], cands[0], session)
                status = await _watched(run, receive)
                return status
            answers = await asyncio.gather(
                *(
                    self._one(req, item, route, c, session)
                    for item, route, c in zip(items, routes, cands, strict=True)
                )
            )
            status = await self._send_answers(send, req, answers, routes)
            return status
        finally:
            for route, key in zip(routes, keys, strict=True):
                proxy.balancer.end(key)
                hist, _ = proxy.metrics.children(route.adapter, route.version)
                hist.observe(time.perf_counter() - t0)
                proxy.metrics.count(route.adapter, route.version, status)
                if route.adapter is not None:
                    proxy.metrics.lag(route.adapter).observe(route.lag)

    def _resolve(self, item: GenerateItem, session: str | None) -> Route:
        model = _lora_model(item.lora_path, self.proxy.store.aliases)
        try:
            return self.proxy.resolve(model, session)
        except ServiceError as exc:
            exc.param = "lora_path"
            if isinstance(exc, InvalidRequest) and model is not None:
                exc.message = exc.message.replace("engine name", "lora_path")
            raise

    def _candidates(self, route: Route) -> list[Replica]:
        b = self.proxy.balancer
        cands = b.candidates(route.replicas, route.base_model)
        if not cands:
            cands = b.known(route.replicas, route.base_model)
            if cands:
                self.proxy.metrics.panic.inc()
        if not cands:
            what = f"{route.adapter} v{route.version}" if route.adapter else "the base model"
            raise NoReplica(f"no replica serves {what!r} right now")
        return cands

    async def _send_answers(
        self, send, req: GenerateRequest, answers: list[_Answer], routes: list[Route]
    ) -> int:
        failed = next((a for a in answers if a.status != 200), None)
        if failed is not None:
            data = failed.body if isinstance(failed.body, bytes) else json.dumps(failed.body)
            headers = [(b"content-type", failed.ctype.encode())]
            await _send_whole(send, failed.status, headers, _b(data))
            return failed.status
        out: Any = [a.body for a in answers]
        if req.batch_size is None:
            out = out[0]
        headers = [(b"content-type", b"application/json")]
        if len(answers) == 1 and answers[0].replica is not None:
            headers += self.proxy._tag_headers(routes[0], answers[0].replica)
        await _send_whole(send, 200, headers, json.dumps(out).encode())
        return 200

    async def _one(
        self,
        req: GenerateRequest,
        item: GenerateItem,
        route: Route,
        cands: list[Replica],
        session: str | None,
    ) -> _Answer:
        """One prompt on one replica (another, once, if the first could not be reached)."""
        return await self._on_replica(
            cands,
            session,
            route,
            lambda replica: (
                self._sglang(req, item, route, replica)
                if replica.kind == "sglang"
                else self._translated(req, item, route, replica)
            ),
        )

    async def _on_replica(
        self,
        cands: list[Replica],
        session: str | None,
        route: Route,
        call: Callable[[Replica], Awaitable[_Answer]],
        *,
        unsent: Callable[[], bool] = lambda: True,
    ) -> _Answer:
        """``call`` on one replica; once more on another if the first could not be reached,
        or its engine said it does not hold the version (while ``unsent()``: nothing of the
        answer has reached the client yet)."""
        from lorafleet.router.proxy import _Unreachable

        proxy = self.proxy
        failed: Replica | None = None
        for _ in range(2):
            replica = proxy.balancer.pick(cands, session, exclude=failed)
            if replica is None:
                break
            replica.inflight += 1
            placed_at = replica.agent_url
            try:
                answer = await call(replica)
                if (
                    failed is None
                    and isinstance(answer.body, bytes)
                    and unsent()
                    and proxy.hand_on(replica, route, answer.status, answer.body, cands)
                ):
                    failed = replica
                    continue
                return answer
            except _Unreachable as exc:
                if replica.agent_url == placed_at:
                    proxy.balancer.failed(replica, exc.detail, definitive=exc.refused, probe=False)
                failed = replica
                proxy.metrics.retries.inc()
            finally:
                replica.inflight -= 1
        exc = EngineUnavailable(
            "could not connect to a replica" if failed else "no healthy replica right now"
        )
        return _Answer(503, json.dumps(error_body(exc.code, exc.message)).encode())

    # --- on an SGLang replica: SGLang's own answer ----------------------------------------------

    def _sglang_body(self, req: GenerateRequest, item: GenerateItem, route: Route) -> dict:
        body: dict[str, Any] = {k: v for k, v in req.extras.items() if k not in ("lora_id",)}
        if item.text is not None:
            body["text"] = item.text
        else:
            body["input_ids"] = item.input_ids
        body["sampling_params"] = item.sampling_params.model_dump(exclude_none=True)
        body["rid"] = item.rid
        body["stream"] = req.stream
        body["return_logprob"] = item.return_logprob
        body["logprob_start_len"] = item.logprob_start_len
        body["top_logprobs_num"] = item.top_logprobs_num
        body["return_text_in_logprobs"] = req.return_text_in_logprobs
        body["lora_path"] = route.engine_name
        return body

    async def _sglang(
        self, req: GenerateRequest, item: GenerateItem, route: Route, replica: Replica
    ) -> _Answer:
        data = json.dumps(self._sglang_body(req, item, route)).encode()
        resp = await self.proxy._send(replica, "/generate", data)
        self.proxy.balancer.succeeded(replica, probe=False)
        try:
            try:
                raw = await resp.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return _broke(exc)
            if resp.status != 200:
                ctype = resp.headers.get("Content-Type", "application/json")
                scrubbed = self.proxy._scrub(raw, route, route.engine_name)
                return _Answer(resp.status, scrubbed, replica, ctype)
            try:
                out = json.loads(raw)
            except ValueError:
                return _broke(ValueError("the engine's answer is not JSON"))
            for one in out if isinstance(out, list) else [out]:
                self._mark(one, route, replica)
            return _Answer(200, out, replica)
        finally:
            resp.release()

    def _mark(self, answer: Any, route: Route, replica: Replica) -> None:
        """Stamp an SGLang answer with the version that produced it."""
        if not isinstance(answer, dict):
            return
        meta = answer.get("meta_info")
        if isinstance(meta, dict) and route.adapter is not None:
            version = str(route.version)
            meta["weight_version"] = version
            spans = meta.get("weight_versions")
            if isinstance(spans, list):
                for span in spans:
                    if isinstance(span, dict):
                        span["version"] = version
        answer[TAG_FIELD] = {
            "adapter": route.adapter,
            "version": route.version,
            "replica": replica.replica_id,
        }

    # --- elsewhere: a streamed completion, translated -------------------------------------------

    def _completion_body(
        self, req: GenerateRequest, item: GenerateItem, route: Route, replica: Replica
    ) -> dict:
        _check_translatable(req, item, replica.kind)
        sp = item.sampling_params
        body: dict[str, Any] = {
            "model": model_field(replica.kind, replica.base_model, route.engine_name),
            "prompt": item.input_ids if item.input_ids is not None else item.text,
            "max_tokens": DEFAULT_MAX_NEW_TOKENS
            if sp.max_new_tokens is None
            else sp.max_new_tokens,
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
        if replica.kind == "vllm":
            for k, v in _VLLM_FIELDS.items():
                value = getattr(sp, k)
                if value is not None:
                    body[v] = value
        # Always the sampled token's logprob: every streamed token then comes with its id, even
        # one whose text is not whole yet.
        body["logprobs"] = item.top_logprobs_num if item.return_logprob else 0
        if not (item.return_logprob and req.return_text_in_logprobs):
            body["return_tokens_as_token_ids"] = True
        return body

    async def _translated(
        self,
        req: GenerateRequest,
        item: GenerateItem,
        route: Route,
        replica: Replica,
        on_frame: Callable[[dict], Awaitable[None]] | None = None,
    ) -> _Answer:
        """Run ``item`` as a streamed completion; SGLang's answer. ``on_frame``: called with
        each cumulative answer while it streams (the client's own stream)."""
        body = self._completion_body(req, item, route, replica)
        started = time.perf_counter()
        prompt_scores = None
        if item.return_logprob and item.logprob_start_len >= 0:
            scored = await self._score_prompt(body, item, route, replica)
            if isinstance(scored, _Answer):
                return scored
            prompt_scores = scored
        resp = await self.proxy._send(replica, "/v1/completions", json.dumps(body).encode())
        self.proxy.balancer.succeeded(replica, probe=False)
        live = _Live(item.rid, replica)
        self.live.setdefault(item.rid, set()).add(live)
        acc = _Accumulated(item, req.return_text_in_logprobs)
        if prompt_scores is not None:
            acc.input_logprobs, acc.input_top = prompt_scores
        watcher = asyncio.ensure_future(_close_on(live.aborted, resp))
        try:
            if resp.status != 200:
                raw = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
                return _Answer(
                    resp.status, self.proxy._scrub(raw, route, body["model"]), replica, ctype
                )
            buf = b""
            try:
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                    grew = False
                    for ev in events:
                        error = acc.feed(ev)
                        if error is not None:
                            return _Answer(
                                400, self.proxy._scrub(error, route, body["model"]), replica
                            )
                        grew = True
                    if grew and on_frame is not None and acc.changed():
                        await on_frame(acc.answer(route, replica, started, final=False))
            except (TimeoutError, aiohttp.ClientError) as exc:
                if not live.aborted.is_set():
                    return _broke(exc)
            if live.aborted.is_set() and acc.finish is None:
                acc.finish = {"type": "abort", "message": "Abort before the answer was complete."}
            elif acc.finish is None:
                return _broke(ValueError("the engine's stream ended without a finish reason"))
            return _Answer(200, acc.answer(route, replica, started, final=True), replica)
        finally:
            watcher.cancel()
            peers = self.live.get(item.rid)
            if peers is not None:
                peers.discard(live)
                if not peers:
                    del self.live[item.rid]
            resp.release()

    async def _score_prompt(
        self, body: dict, item: GenerateItem, route: Route, replica: Replica
    ) -> tuple[list, list] | _Answer:
        """The prompt's logprobs from ``logprob_start_len`` on, as SGLang lists them: the
        engine echoes the prompt with its logprobs (one request, one token generated and
        dropped); the first listed position has no logprob, as in SGLang's answer."""
        top = item.top_logprobs_num
        score = {
            "model": body["model"],
            "prompt": body["prompt"],
            "max_tokens": 1,
            "temperature": 0,
            "echo": True,
            "logprobs": top,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        resp = await self.proxy._send(replica, "/v1/completions", json.dumps(score).encode())
        try:
            raw = await resp.read()
            if resp.status != 200:
                return _Answer(resp.status, self.proxy._scrub(raw, route, body["model"]), replica)
            out = json.loads(raw)
            choice = out["choices"][0]
            lp = choice["logprobs"]
            n = len(item.input_ids) if item.input_ids is not None else out["usage"]["prompt_tokens"]
            tokens, values = lp["tokens"][:n], lp["token_logprobs"][:n]
            tops = (lp.get("top_logprobs") or [None] * n)[:n]
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            return _broke(exc)
        finally:
            resp.release()
        start = item.logprob_start_len
        ids = [_token_id(t) for t in tokens]
        logprobs = [[values[k], ids[k], None] for k in range(start, len(ids))]
        tops_out: list = []
        for k in range(start, len(ids)):
            d = tops[k]
            alts = sorted(((v, _token_id(t)) for t, v in (d or {}).items()), key=lambda x: -x[0])
            tops_out.append([[v, t, None] for v, t in alts[:top]] if d else None)
        if logprobs:
            logprobs[0][0] = None
            if tops_out:
                tops_out[0] = None
        return logprobs, tops_out

    # --- streams --------------------------------------------------------------------------------

    async def _stream(
        self,
        send,
        req: GenerateRequest,
        item: GenerateItem,
        route: Route,
        cands: list[Replica],
        session: str | None,
    ) -> int:
        started = False
        proxy = self.proxy

        async def start(replica: Replica) -> None:
            nonlocal started
            if not started:
                headers = proxy._tag_headers(route, replica)
                headers.append((b"content-type", b"text/event-stream; charset=utf-8"))
                headers.append((b"cache-control", b"no-cache"))
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True

        async def frame(replica: Replica, doc: dict) -> None:
            await start(replica)
            data = b"data: " + json.dumps(doc).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def call(replica: Replica) -> _Answer:
            if replica.kind == "sglang":
                return await self._sglang_stream(req, item, route, replica, start, send)
            answer = await self._translated(
                req, item, route, replica, on_frame=lambda d: frame(replica, d)
            )
            if answer.status == 200:
                await frame(replica, answer.body)
            return answer

        answer = await self._on_replica(cands, session, route, call, unsent=lambda: not started)
        if not started:
            # Nothing was sent yet: a plain error answer, as SGLang's own refusals are.
            body = answer.body if isinstance(answer.body, bytes) else json.dumps(answer.body)
            await _send_whole(
                send, answer.status, [(b"content-type", b"application/json")], _b(body)
            )
            return answer.status
        if answer.status != 200:
            err = _error_doc(answer.body, answer.status)
            data = b"data: " + json.dumps(err).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        if answer.body != "sent":
            await send({"type": "http.response.body", "body": _DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return 200

    async def _sglang_stream(
        self,
        req: GenerateRequest,
        item: GenerateItem,
        route: Route,
        replica: Replica,
        start: Callable[[Replica], Awaitable[None]],
        send,
    ) -> _Answer:
        """Relay SGLang's own stream, each event stamped with the version."""
        data = json.dumps(self._sglang_body(req, item, route)).encode()
        resp = await self.proxy._send(replica, "/generate", data)
        self.proxy.balancer.succeeded(replica, probe=False)
        try:
            ctype = resp.headers.get("Content-Type", "")
            if resp.status != 200 or "text/event-stream" not in ctype:
                raw = await resp.read()
                return _Answer(
                    resp.status, self.proxy._scrub(raw, route, route.engine_name), replica
                )
            await start(replica)
            buf = b""
            done = False
            try:
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                    out = b"".join(self._stamp_event(ev, route, replica) for ev in events if ev)
                    done = done or any(ev.strip() == _DONE.strip() for ev in events)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
            except (TimeoutError, aiohttp.ClientError) as exc:
                return _broke(exc)
            if buf.strip():
                done = done or buf.strip() == _DONE.strip()
                last = self._stamp_event(buf, route, replica)
                await send({"type": "http.response.body", "body": last, "more_body": True})
            if not done:
                return _broke(ValueError("the engine's stream ended without data: [DONE]"))
            return _Answer(200, "sent", replica)
        finally:
            resp.release()

    def _stamp_event(self, ev: bytes, route: Route, replica: Replica) -> bytes:
        ev = ev.strip(b"\n")
        if ev.startswith(b"data: {"):
            try:
                doc = json.loads(ev[6:])
            except ValueError:
                return ev + b"\n\n"
            if "error" in doc:
                raw = self.proxy._scrub(ev, route, route.engine_name)
                return raw + b"\n\n"
            self._mark(doc, route, replica)
            return b"data: " + json.dumps(doc).encode() + b"\n\n"
        return ev + b"\n\n"

    # --- abort ----------------------------------------------------------------------------------

    async def abort(self, rid: str, abort_all: bool, replicas: list[Replica] | None = None) -> int:
        """Abort ``rid`` (or everything) on ``replicas`` (None: all); how many translated
        requests were ended. SGLang replicas get SGLang's own call."""
        targets = self.proxy.balancer.replicas if replicas is None else replicas
        ended = 0
        for lives in list(self.live.values()):
            for live in lives:
                if live.replica in targets and (abort_all or live.rid == rid):
                    live.aborted.set()
                    ended += 1
        body = json.dumps({"rid": rid, "abort_all": abort_all}).encode()
        sglang = [r for r in targets if r.kind == "sglang" and r.engine_url is not None]

        async def one(r: Replica) -> None:
            with contextlib.suppress(Exception):
                resp = await self.proxy.session.post(
                    r.engine_url + "/abort_request", data=body, headers=_JSON
                )
                resp.release()

        await asyncio.gather(*(one(r) for r in sglang))
        return ended


class _Accumulated:
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
            tid = _token_id(tok)
            if tid is None:  # text tokens (return_text_in_logprobs): the ids come beside
                tid = ids[k] if k < len(ids) else -1
            text = tok if self.text_in_logprobs else None
            self.logprobs.append([values[k], tid, text])
            n = self.item.top_logprobs_num
            if n > 0:
                alts = sorted(
                    ((v, _token_id(t)) for t, v in (tops[k] or {}).items()),
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
            TAG_FIELD: {
                "adapter": route.adapter,
                "version": route.version,
                "replica": replica.replica_id,
            },
        }


# --- helpers ------------------------------------------------------------------------------------


def _parse(body: dict) -> GenerateRequest:
    try:
        req = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        # Union members name themselves in the location (``SamplingParams``): not a field.
        loc = ".".join(
            str(p) for p in first.get("loc", ()) if not (isinstance(p, str) and p[:1].isupper())
        )
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        raise InvalidRequest(f"{loc}: {msg}" if loc else msg, param=loc or None) from None
    for k, what in _NEVER.items():
        if req.extras.get(k) is not None:
            raise InvalidRequest(
                f"{what} cannot be honoured by lorafleet's router: each request may go to "
                "another replica",
                param=k,
            )
    return req


def _lora_model(lora_path: str | None, aliases: dict) -> str | None:
    """``lora_path`` as the router's ``model``: the name, ``name@vN``, or ``<name>-v<N>`` of a
    published name as its pin ``name@vN``."""
    if lora_path is None or lora_path in aliases or "@v" in lora_path:
        return lora_path
    tn = _NAMES.parse(lora_path)
    if tn.version is not None and tn.name in aliases:
        return NameMap.router_model(TrainerName(tn.name, tn.version))
    return lora_path


def _check_translatable(req: GenerateRequest, item: GenerateItem, kind: str) -> None:
    """Refuse (400) what a completion request on ``kind`` cannot honour."""
    where = f"on a {kind} replica (SGLang's own engine answers it)"
    for k, v in req.extras.items():
        if k in _HARMLESS:
            if k.endswith("_data") and v:
                raise InvalidRequest(f"{k} (multimodal input) is not carried {where}", param=k)
            continue
        if v not in (None, False, 0, "", [], {}):
            raise InvalidRequest(f"{k} is not supported {where}", param=k)
    if (
        item.return_logprob
        and item.logprob_start_len >= 0
        and item.top_logprobs_num
        and (kind == "reference")
    ):
        raise InvalidRequest(
            f"top_logprobs_num with logprob_start_len {item.logprob_start_len} (the prompt's top "
            f"logprobs) is not supported {where}; the reference engine scores only the prompt's "
            "own tokens",
            param="logprob_start_len",
        )
    if item.logprob_start_len < -1:
        raise InvalidRequest(
            "logprob_start_len is -1 or a prompt position", param="logprob_start_len"
        )
    if item.top_logprobs_num and req.return_text_in_logprobs:
        raise InvalidRequest(
            f"top_logprobs_num with return_text_in_logprobs is not supported {where}",
            param="return_text_in_logprobs",
        )
    sp = item.sampling_params
    for k, allowed in _DEFAULTS.items():
        value = getattr(sp, k)
        if kind == "vllm" and k in _VLLM_FIELDS:
            continue
        if k == "top_k" and _keeps_every_token(value):
            continue
        ok = value is None if allowed is None else value in allowed
        if not ok:
            raise InvalidRequest(
                f"sampling_params.{k}={value!r} is not supported {where}",
                param=f"sampling_params.{k}",
            )


def _keeps_every_token(top_k: object) -> bool:
    """A top_k no vocabulary reaches samples from all of it, as no top_k does (AReaL sends 1e8)."""
    return isinstance(top_k, int) and top_k >= 1 << 24


def _token_id(tok: str) -> int | None:
    # vLLM's return_tokens_as_token_ids names a token "token_id:<id>" (format_token_id_placeholder).
    if isinstance(tok, str) and tok.startswith("token_id:"):
        with contextlib.suppress(ValueError):
            return int(tok[9:])
    return None


def _broke(exc: BaseException) -> _Answer:
    err = StreamInterrupted(f"the engine's answer broke off: {type(exc).__name__}: {exc}")
    return _Answer(502, json.dumps(error_body(err.code, err.message)).encode())


def _error_doc(body: Any, status: int) -> dict:
    """An error answer as the error event SGLang ends a stream with."""
    try:
        doc = json.loads(body) if isinstance(body, bytes | str) else body
        message = doc["error"]["message"] if isinstance(doc.get("error"), dict) else str(doc)
    except (ValueError, TypeError, KeyError, AttributeError):
        message = _b(body).decode("utf-8", "replace")
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "code": status,
            "retryable": status >= 500,
        }
    }


def _b(data: bytes | str) -> bytes:
    return data if isinstance(data, bytes) else data.encode()


async def _send_whole(send, status: int, headers: list, body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _close_on(event: asyncio.Event, resp: aiohttp.ClientResponse) -> None:
    """Close ``resp`` when ``event`` is set: the engine sees the client leave and stops."""
    await event.wait()
    resp.close()


async def _watched(run, receive) -> int:
    from lorafleet.router.proxy import _watched as watched

    return await watched(run, receive)
