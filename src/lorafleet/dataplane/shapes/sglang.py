"""SGLang's native ``POST /generate`` (text or ``input_ids``), for every engine kind.

On an engine that serves ``/generate`` itself (its kind's ``native_routes``: SGLang) the request
goes there with ``lora_path`` set to the version's engine name, and the engine's answer comes
back as it was, with ``meta_info.weight_version`` set to the lorafleet version that produced it
and a ``lorafleet`` version tag. Elsewhere it becomes a streamed token-id completion and the
answer is rebuilt in SGLang's shape (``sglang_translate.py``). One prompt on one replica, either
way, is ``sglang_replica.py``; this module parses, resolves, splits a batch and answers.

``lora_path`` is resolved at arrival as ``model`` is on the OpenAI routes: a lorafleet name (its
newest version, or the one a session started on), ``name@vN``, or a trainer's ``<name>-v<N>``
(``lorafleet.protocol.trainer_names``); absent or null is the base model. A batch is split into
its prompts, each routed on its own and answered in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from lorafleet.dataplane.addressing import Route
from lorafleet.dataplane.balancer import Replica
from lorafleet.dataplane.relay import send_whole, watched
from lorafleet.dataplane.shapes.base import Call, HandOn, Pipe, Shape, parse
from lorafleet.dataplane.shapes.sglang_replica import (
    DONE,
    Answer,
    native,
    native_stream,
    translated,
)
from lorafleet.dataplane.tagging import tag_headers
from lorafleet.engine_kinds import engine_kind
from lorafleet.errors import EngineUnavailable, InvalidRequest, ServiceError
from lorafleet.protocol.errors import error_body
from lorafleet.protocol.generation import GenerateItem, GenerateRequest, is_native_generate
from lorafleet.protocol.tenants import Tenant
from lorafleet.protocol.trainer_names import NameMap, TrainerName

__all__ = ["SGLangGenerate"]

_NAMES = NameMap()
_JSON = [(b"content-type", b"application/json")]
# Fields of GenerateReqInput that no replica of a lorafleet fleet can honour: engine-side state
# that another replica (or another version) does not share, or inputs the router cannot check.
_NEVER = {
    "input_embeds": "input_embeds (prompt embeddings)",
    "session_params": "session_params (SGLang's engine-side sessions; use X-Session-ID)",
    "lora_id": "lora_id (SGLang's internal adapter id; name the adapter in lora_path)",
}


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
        models = [_lora_model(item.lora_path, pipe.table.aliases, call.tenant) for item in items]
        for model in models:
            with _as_lora_path(model):
                pipe.check_scope(call.tenant, model)
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
    ) -> Answer:
        """One prompt on one replica (another, once, if the first could not take it)."""

        async def run(replica: Replica) -> Answer:
            if self.path in engine_kind(replica.kind).native_routes:
                return await native(pipe, req, item, route, replica)
            return await translated(pipe, req, item, route, replica)

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

        async def run(replica: Replica) -> Answer:
            if self.path in engine_kind(replica.kind).native_routes:
                return await native_stream(pipe, req, item, route, replica, start, send)
            answer = await translated(
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
            await send({"type": "http.response.body", "body": DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return 200


async def _on_replica(
    pipe: Pipe,
    route: Route,
    cands: list[Replica],
    session: str | None,
    call: Callable[[Replica], Awaitable[Answer]],
    *,
    unsent: Callable[[], bool] = lambda: True,
) -> Answer:
    """``call`` through ``Pipeline.attempt``: an engine's "I do not hold it" hands the prompt on
    while nothing of its answer has reached the client (``unsent``)."""

    async def run(replica: Replica, may_hand_on: bool) -> Answer:
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
        return Answer(exc.status, json.dumps(error_body(exc.code, exc.message)).encode())


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
    with _as_lora_path(model):
        route = pipe.resolve(model, session)
    return route


@contextlib.contextmanager
def _as_lora_path(model: str | None) -> Iterator[None]:
    """A refusal of ``model`` names the field it came from, ``lora_path``."""
    try:
        yield
    except ServiceError as exc:
        exc.param = "lora_path"
        if isinstance(exc, InvalidRequest) and model is not None:
            exc.message = exc.message.replace("engine name", "lora_path")
        raise


def _lora_model(lora_path: str | None, aliases: dict, tenant: Tenant | None = None) -> str | None:
    """``lora_path`` as the router's ``model``: the name, ``name@vN``, or ``<name>-v<N>`` of a
    published name as its pin ``name@vN``. For a tenant, only its own names count as published:
    whether another tenant's name exists must not change what its request becomes."""
    if lora_path is None or lora_path in aliases or "@v" in lora_path:
        return lora_path
    tn = _NAMES.parse(lora_path)
    if tn.version is not None and tn.name in aliases and (tenant is None or tenant.owns(tn.name)):
        return NameMap.router_model(TrainerName(tn.name, tn.version))
    return lora_path


async def _send_answers(
    send, req: GenerateRequest, answers: list[Answer], routes: list[Route]
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
