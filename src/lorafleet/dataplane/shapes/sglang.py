"""SGLang's native ``POST /generate`` (text or ``input_ids``), for every engine kind.

On an engine that serves ``/generate`` itself (its kind's ``native_routes``: SGLang) the request
goes there with ``lora_path`` set to the version's engine name, and the engine's answer comes
back as it was, with ``meta_info.weight_version`` set to the lorafleet version that produced it
and a ``lorafleet`` version tag. Elsewhere it becomes a streamed token-id completion and the
answer is rebuilt in SGLang's shape (``sglang_translate.py``).

``lora_path`` is resolved at arrival as ``model`` is on the OpenAI routes: a lorafleet name (its
newest version, or the one a session started on), ``name@vN``, or a trainer's ``<name>-v<N>``
(``lorafleet.protocol.trainer_names``); absent or null is the base model. A batch is split into
its prompts, each routed on its own and answered in order.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.relay import send_whole, watched
from lorafleet.dataplane.shapes.base import Call, HandOn, Pipe, Shape, parse
from lorafleet.dataplane.shapes.sglang_translate import (
    Accumulated,
    completion_body,
    prompt_scores,
    score_body,
)
from lorafleet.dataplane.tagging import broke_off, scrub, tag_doc, tag_headers
from lorafleet.engine_kinds import engine_kind
from lorafleet.errors import EngineUnavailable, InvalidRequest, ServiceError, StreamInterrupted
from lorafleet.protocol.errors import error_body
from lorafleet.protocol.generation import GenerateItem, GenerateRequest, is_native_generate
from lorafleet.protocol.router import TAG_FIELD
from lorafleet.protocol.trainer_names import NameMap, TrainerName

__all__ = ["SGLangGenerate"]

_NAMES = NameMap()
_DONE = b"data: [DONE]\n\n"
_JSON = [(b"content-type", b"application/json")]
# Fields of GenerateReqInput that no replica of a lorafleet fleet can honour: engine-side state
# that another replica (or another version) does not share, or inputs the router cannot check.
_NEVER = {
    "input_embeds": "input_embeds (prompt embeddings)",
    "session_params": "session_params (SGLang's engine-side sessions; use X-Session-ID)",
    "lora_id": "lora_id (SGLang's internal adapter id; name the adapter in lora_path)",
}


@dataclass
class _Answer:
    status: int
    body: Any
    """A JSON-ready answer (200), ``"sent"`` (streamed already), or the engine's error bytes."""
    replica: Replica | None = None
    ctype: str = "application/json"


class SGLangGenerate(Shape):
    """SGLang's ``/generate`` (see the module docstring)."""

    path = "/generate"
    summary = (
        "SGLang's native generation: {text | input_ids, sampling_params, lora_path, "
        "return_logprob, stream, rid, ...}, batched or not, on every engine kind"
    )
    model = GenerateRequest
    streams = True

    def accepts(self, doc: dict[str, Any]) -> bool:
        return is_native_generate(doc)

    async def handle(self, pipe: Pipe, call: Call) -> None:
        req = _parse(call.doc)
        items = req.items()
        if req.stream and req.batch_size is not None:
            raise InvalidRequest(
                "a batched stream is not supported by lorafleet's router: stream one prompt "
                "per request",
                param="stream",
            )
        models = [_lora_model(item.lora_path, pipe.table.aliases) for item in items]
        await pipe.admit(models, call.session)
        routes = [_resolve(pipe, model, call.session) for model in models]
        cands = [pipe.candidates(route) for route in routes]
        with pipe.accounted(routes, call.t0) as outcome:
            if req.stream:
                run = self._stream(pipe, call, req, items[0], routes[0], cands[0])
                outcome.status = await watched(run, call.receive)
                return
            answers = await asyncio.gather(
                *(
                    self._one(pipe, call, req, item, route, c)
                    for item, route, c in zip(items, routes, cands, strict=True)
                )
            )
            outcome.status = await _send_answers(call.send, req, answers, routes)

    # --- one prompt ----------------------------------------------------------------------------

    async def _one(
        self,
        pipe: Pipe,
        call: Call,
        req: GenerateRequest,
        item: GenerateItem,
        route: Route,
        cands: list[Replica],
    ) -> _Answer:
        """One prompt on one replica (another, once, if the first could not take it)."""

        async def run(replica: Replica) -> _Answer:
            if self.path in engine_kind(replica.kind).native_routes:
                return await _native(pipe, req, item, route, replica)
            return await _translated(pipe, req, item, route, replica)

        return await _on_replica(pipe, route, cands, call.session, run)

    async def _stream(
        self,
        pipe: Pipe,
        call: Call,
        req: GenerateRequest,
        item: GenerateItem,
        route: Route,
        cands: list[Replica],
    ) -> int:
        started = False
        send = call.send

        async def start(replica: Replica) -> None:
            nonlocal started
            if not started:
                headers = tag_headers(route, replica)
                headers.append((b"content-type", b"text/event-stream; charset=utf-8"))
                headers.append((b"cache-control", b"no-cache"))
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True

        async def frame(replica: Replica, doc: dict) -> None:
            await start(replica)
            data = b"data: " + json.dumps(doc).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def run(replica: Replica) -> _Answer:
            if self.path in engine_kind(replica.kind).native_routes:
                return await _native_stream(pipe, req, item, route, replica, start, send)
            answer = await _translated(
                pipe, req, item, route, replica, on_frame=lambda d: frame(replica, d)
            )
            if answer.status == 200:
                await frame(replica, answer.body)
            return answer

        answer = await _on_replica(
            pipe, route, cands, call.session, run, unsent=lambda: not started
        )
        if not started:
            # Nothing was sent yet: a plain error answer, as SGLang's own refusals are.
            await send_whole(send, answer.status, _JSON, _b(_serialised(answer.body)))
            return answer.status
        if answer.status != 200:
            err = _error_doc(answer.body, answer.status)
            data = b"data: " + json.dumps(err).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        if answer.body != "sent":
            await send({"type": "http.response.body", "body": _DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return 200


async def _on_replica(
    pipe: Pipe,
    route: Route,
    cands: list[Replica],
    session: str | None,
    call: Callable[[Replica], Awaitable[_Answer]],
    *,
    unsent: Callable[[], bool] = lambda: True,
) -> _Answer:
    """``call`` through ``Pipeline.attempt``: an engine's "I do not hold it" hands the prompt on
    while nothing of its answer has reached the client (``unsent``)."""

    async def run(replica: Replica, may_hand_on: bool) -> _Answer:
        answer = await call(replica)
        if (
            may_hand_on
            and isinstance(answer.body, bytes)
            and unsent()
            and pipe.hand_on(replica, route, answer.status, answer.body, cands)
        ):
            raise HandOn
        return answer

    try:
        return await pipe.attempt(route, cands, session, run)
    except EngineUnavailable as exc:
        return _Answer(exc.status, json.dumps(error_body(exc.code, exc.message)).encode())


# --- on an engine that serves /generate: its own answer -----------------------------------------


def _native_body(req: GenerateRequest, item: GenerateItem, route: Route) -> bytes:
    body: dict[str, Any] = {k: v for k, v in req.extras.items() if k != "lora_id"}
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
    return json.dumps(body).encode()


async def _native(
    pipe: Pipe, req: GenerateRequest, item: GenerateItem, route: Route, replica: Replica
) -> _Answer:
    resp = await pipe.post(replica, "/generate", _native_body(req, item, route))
    try:
        try:
            raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _broke(exc)
        if resp.status != 200:
            ctype = resp.headers.get("Content-Type", "application/json")
            return _Answer(resp.status, scrub(raw, route, route.engine_name), replica, ctype)
        try:
            out = json.loads(raw)
        except ValueError:
            return _broke(ValueError("the engine's answer is not JSON"))
        for one in out if isinstance(out, list) else [out]:
            _mark(one, route, replica)
        return _Answer(200, out, replica)
    finally:
        resp.release()


async def _native_stream(
    pipe: Pipe,
    req: GenerateRequest,
    item: GenerateItem,
    route: Route,
    replica: Replica,
    start: Callable[[Replica], Awaitable[None]],
    send,
) -> _Answer:
    """Relay the engine's own stream, each event stamped with the version."""
    resp = await pipe.post(replica, "/generate", _native_body(req, item, route))
    try:
        ctype = resp.headers.get("Content-Type", "")
        if resp.status != 200 or "text/event-stream" not in ctype:
            raw = await resp.read()
            return _Answer(resp.status, scrub(raw, route, route.engine_name), replica)
        await start(replica)
        buf = b""
        done = False
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                out = b"".join(_stamp_event(ev, route, replica) for ev in events if ev)
                done = done or any(ev.strip() == _DONE.strip() for ev in events)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _broke(exc)
        if buf.strip():
            done = done or buf.strip() == _DONE.strip()
            last = _stamp_event(buf, route, replica)
            await send({"type": "http.response.body", "body": last, "more_body": True})
        if not done:
            return _broke(ValueError("the engine's stream ended without data: [DONE]"))
        return _Answer(200, "sent", replica)
    finally:
        resp.release()


def _stamp_event(ev: bytes, route: Route, replica: Replica) -> bytes:
    ev = ev.strip(b"\n")
    if ev.startswith(b"data: {"):
        try:
            doc = json.loads(ev[6:])
        except ValueError:
            return ev + b"\n\n"
        if "error" in doc:
            return scrub(ev, route, route.engine_name) + b"\n\n"
        _mark(doc, route, replica)
        return b"data: " + json.dumps(doc).encode() + b"\n\n"
    return ev + b"\n\n"


def _mark(answer: Any, route: Route, replica: Replica) -> None:
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
    answer[TAG_FIELD] = tag_doc(route, replica)


# --- elsewhere: a streamed completion, translated ------------------------------------------------


async def _translated(
    pipe: Pipe,
    req: GenerateRequest,
    item: GenerateItem,
    route: Route,
    replica: Replica,
    on_frame: Callable[[dict], Awaitable[None]] | None = None,
) -> _Answer:
    """Run ``item`` as a streamed completion; SGLang's answer. ``on_frame``: called with each
    cumulative answer while it streams (the client's own stream)."""
    body = completion_body(req, item, route, replica)
    started = time.perf_counter()
    acc = Accumulated(item, req.return_text_in_logprobs)
    if item.return_logprob and item.logprob_start_len >= 0:
        scored = await _score_prompt(pipe, body, item, route, replica)
        if isinstance(scored, _Answer):
            return scored
        acc.input_logprobs, acc.input_top = scored
    resp = await pipe.post(replica, "/v1/completions", json.dumps(body).encode())
    with pipe.live.running(item.rid, replica) as live:
        watcher = asyncio.ensure_future(_close_on(live.aborted, resp))
        try:
            if resp.status != 200:
                raw = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
                return _Answer(resp.status, scrub(raw, route, body["model"]), replica, ctype)
            buf = b""
            try:
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                    grew = False
                    for ev in events:
                        error = acc.feed(ev)
                        if error is not None:
                            return _Answer(400, scrub(error, route, body["model"]), replica)
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
            resp.release()


async def _score_prompt(
    pipe: Pipe, body: dict, item: GenerateItem, route: Route, replica: Replica
) -> tuple[list, list] | _Answer:
    """The prompt's logprobs, asked of the engine as an echoed completion."""
    resp = await pipe.post(replica, "/v1/completions", json.dumps(score_body(body, item)).encode())
    try:
        raw = await resp.read()
        if resp.status != 200:
            return _Answer(resp.status, scrub(raw, route, body["model"]), replica)
        return prompt_scores(json.loads(raw), item)
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
        return _broke(exc)
    finally:
        resp.release()


# --- helpers ------------------------------------------------------------------------------------


def _parse(doc: dict) -> GenerateRequest:
    req = parse(GenerateRequest, doc)
    assert isinstance(req, GenerateRequest)
    for k, what in _NEVER.items():
        if req.extras.get(k) is not None:
            raise InvalidRequest(
                f"{what} cannot be honoured by lorafleet's router: each request may go to "
                "another replica",
                param=k,
            )
    return req


def _resolve(pipe: Pipe, model: str | None, session: str | None) -> Route:
    try:
        return pipe.resolve(model, session)
    except ServiceError as exc:
        exc.param = "lora_path"
        if isinstance(exc, InvalidRequest) and model is not None:
            exc.message = exc.message.replace("engine name", "lora_path")
        raise


def _lora_model(lora_path: str | None, aliases: dict) -> str | None:
    """``lora_path`` as the router's ``model``: the name, ``name@vN``, or ``<name>-v<N>`` of a
    published name as its pin ``name@vN``."""
    if lora_path is None or lora_path in aliases or "@v" in lora_path:
        return lora_path
    tn = _NAMES.parse(lora_path)
    if tn.version is not None and tn.name in aliases:
        return NameMap.router_model(TrainerName(tn.name, tn.version))
    return lora_path


async def _send_answers(
    send, req: GenerateRequest, answers: list[_Answer], routes: list[Route]
) -> int:
    failed = next((a for a in answers if a.status != 200), None)
    if failed is not None:
        headers = [(b"content-type", failed.ctype.encode())]
        await send_whole(send, failed.status, headers, _b(_serialised(failed.body)))
        return failed.status
    out: Any = [a.body for a in answers]
    if req.batch_size is None:
        out = out[0]
    headers = list(_JSON)
    if len(answers) == 1 and answers[0].replica is not None:
        headers += tag_headers(routes[0], answers[0].replica)
    await send_whole(send, 200, headers, json.dumps(out).encode())
    return 200


def _broke(exc: BaseException) -> _Answer:
    err = StreamInterrupted(broke_off(exc))
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


def _serialised(body: Any) -> bytes | str:
    return body if isinstance(body, bytes) else json.dumps(body)


def _b(data: bytes | str) -> bytes:
    return data if isinstance(data, bytes) else data.encode()


async def _close_on(event: asyncio.Event, resp: aiohttp.ClientResponse) -> None:
    """Close ``resp`` when ``event`` is set: the engine sees the client leave and stops."""
    await event.wait()
    resp.close()
