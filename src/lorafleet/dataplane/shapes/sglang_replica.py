"""One prompt of SGLang's native ``/generate`` on one replica (``sglang.py`` routes it here).

On an engine that serves ``/generate`` itself the request goes there with ``lora_path`` set to
the version's engine name and its answer comes back as it was, stamped with the version
(``native``, ``native_stream``). Elsewhere it runs as a streamed token-id completion and the
answer is rebuilt in SGLang's shape (``translated``; the body translation is
``sglang_translate.py``).
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
from lorafleet.dataplane.shapes.base import Pipe
from lorafleet.dataplane.shapes.sglang_translate import (
    Accumulated,
    completion_body,
    prompt_scores,
    score_body,
)
from lorafleet.dataplane.tagging import broke_off, scrub, tag_doc
from lorafleet.errors import StreamInterrupted
from lorafleet.protocol.errors import error_body
from lorafleet.protocol.generation import GenerateItem, GenerateRequest
from lorafleet.protocol.router import TAG_FIELD

__all__ = ["DONE", "Answer", "broke", "native", "native_stream", "translated"]

DONE = b"data: [DONE]\n\n"


@dataclass
class Answer:
    status: int
    body: Any
    """A JSON-ready answer (200), ``"sent"`` (streamed already), or the engine's error bytes."""
    replica: Replica | None = None
    ctype: str = "application/json"


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


async def native(
    pipe: Pipe, req: GenerateRequest, item: GenerateItem, route: Route, replica: Replica
) -> Answer:
    resp = await pipe.post(replica, "/generate", _native_body(req, item, route))
    try:
        try:
            raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            return broke(exc)
        if resp.status != 200:
            ctype = resp.headers.get("Content-Type", "application/json")
            return Answer(resp.status, scrub(raw, route, route.engine_name), replica, ctype)
        try:
            out = json.loads(raw)
        except ValueError:
            return broke(ValueError("the engine's answer is not JSON"))
        for one in out if isinstance(out, list) else [out]:
            _mark(one, route, replica)
        return Answer(200, out, replica)
    finally:
        resp.release()


async def native_stream(
    pipe: Pipe,
    req: GenerateRequest,
    item: GenerateItem,
    route: Route,
    replica: Replica,
    start: Callable[[Replica], Awaitable[None]],
    send,
) -> Answer:
    """Relay the engine's own stream, each event stamped with the version."""
    resp = await pipe.post(replica, "/generate", _native_body(req, item, route))
    try:
        ctype = resp.headers.get("Content-Type", "")
        if resp.status != 200 or "text/event-stream" not in ctype:
            raw = await resp.read()
            return Answer(resp.status, scrub(raw, route, route.engine_name), replica)
        await start(replica)
        buf = b""
        done = False
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                out = b"".join(_stamp_event(ev, route, replica) for ev in events if ev)
                done = done or any(ev.strip() == DONE.strip() for ev in events)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except (TimeoutError, aiohttp.ClientError) as exc:
            return broke(exc)
        if buf.strip():
            done = done or buf.strip() == DONE.strip()
            last = _stamp_event(buf, route, replica)
            await send({"type": "http.response.body", "body": last, "more_body": True})
        if not done:
            return broke(ValueError("the engine's stream ended without data: [DONE]"))
        return Answer(200, "sent", replica)
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


async def translated(
    pipe: Pipe,
    req: GenerateRequest,
    item: GenerateItem,
    route: Route,
    replica: Replica,
    on_frame: Callable[[dict], Awaitable[None]] | None = None,
) -> Answer:
    """Run ``item`` as a streamed completion; SGLang's answer. ``on_frame``: called with each
    cumulative answer while it streams (the client's own stream)."""
    body = completion_body(req, item, route, replica)
    started = time.perf_counter()
    acc = Accumulated(item, req.return_text_in_logprobs)
    if item.return_logprob and item.logprob_start_len >= 0:
        scored = await _score_prompt(pipe, body, item, route, replica)
        if isinstance(scored, Answer):
            return scored
        acc.input_logprobs, acc.input_top = scored
    resp = await pipe.post(replica, "/v1/completions", json.dumps(body).encode())
    with pipe.live.running(item.rid, replica) as live:
        watcher = asyncio.ensure_future(_close_on(live.aborted, resp))
        try:
            if resp.status != 200:
                raw = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
                return Answer(resp.status, scrub(raw, route, body["model"]), replica, ctype)
            buf = b""
            try:
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                    grew = False
                    for ev in events:
                        error = acc.feed(ev)
                        if error is not None:
                            return Answer(400, scrub(error, route, body["model"]), replica)
                        grew = True
                    if grew and on_frame is not None and acc.changed():
                        await on_frame(acc.answer(route, replica, started, final=False))
            except (TimeoutError, aiohttp.ClientError) as exc:
                if not live.aborted.is_set():
                    return broke(exc)
            if live.aborted.is_set() and acc.finish is None:
                acc.finish = {"type": "abort", "message": "Abort before the answer was complete."}
            elif acc.finish is None:
                return broke(ValueError("the engine's stream ended without a finish reason"))
            return Answer(200, acc.answer(route, replica, started, final=True), replica)
        finally:
            watcher.cancel()
            resp.release()


async def _score_prompt(
    pipe: Pipe, body: dict, item: GenerateItem, route: Route, replica: Replica
) -> tuple[list, list] | Answer:
    """The prompt's logprobs, asked of the engine as an echoed completion."""
    resp = await pipe.post(replica, "/v1/completions", json.dumps(score_body(body, item)).encode())
    try:
        raw = await resp.read()
        if resp.status != 200:
            return Answer(resp.status, scrub(raw, route, body["model"]), replica)
        return prompt_scores(json.loads(raw), item)
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
        return broke(exc)
    finally:
        resp.release()


def broke(exc: BaseException) -> Answer:
    err = StreamInterrupted(broke_off(exc))
    return Answer(502, json.dumps(error_body(err.code, err.message)).encode())


async def _close_on(event: asyncio.Event, resp: aiohttp.ClientResponse) -> None:
    """Close ``resp`` when ``event`` is set: the engine sees the client leave and stops."""
    await event.wait()
    resp.close()
