"""The data plane's hot path as a bare ASGI handler: what every generation shape shares.

Why not FastAPI here: routing, dependency injection and response classes cost tens of
microseconds per request, and this path has a latency budget of a few hundred. The pipeline
checks the API key, reads the body under its cap, parses it once and hands it to the shape its
path names (``shapes/``). A shape resolves ``model`` against the alias table **at arrival**
(``resolve``), takes its candidates (``candidates``) and counts the request in flight
(``accounted``) with no ``await`` in between (see balancer.py); ``attempt`` then runs it on one
replica, and once more on another if the first could not be reached or its engine said it does
not hold the version (``hand_on``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import aiohttp
import orjson

from lorafleet._service import check_token, identify_caller, send_error
from lorafleet.dataplane.aborts import LiveRequests
from lorafleet.dataplane.addressing import Addressing, Route, TableView
from lorafleet.dataplane.balancer import Balancer, Replica
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.relay import relay_stream, relay_whole, watched
from lorafleet.dataplane.shapes import SHAPES, Dispatch
from lorafleet.dataplane.shapes.base import Call, ForwardShape, HandOn, Outcome, Shape
from lorafleet.dataplane.upstream import Unreachable, Upstream
from lorafleet.engine_kinds import engine_kind
from lorafleet.errors import (
    AdapterCold,
    BodyTooLarge,
    EngineRejected,
    EngineUnavailable,
    Forbidden,
    InvalidName,
    InvalidRequest,
    LorafleetError,
    NoReplica,
    NotFound,
    ServiceError,
    StaleVersion,
    StreamInterrupted,
    TableStale,
    Unauthorized,
    VersionNotRoutable,
)
from lorafleet.protocol.names import is_valid_name
from lorafleet.protocol.router import SESSION_HEADER
from lorafleet.protocol.tenants import Tenant, Tenants

__all__ = ["DATA_PLANE_ERRORS", "MAX_BODY", "Gate", "Pipeline", "Warmer"]

T = TypeVar("T")

MAX_BODY = 32 << 20
DATA_PLANE_ERRORS: tuple[type[ServiceError], ...] = (
    InvalidRequest,
    InvalidName,
    Unauthorized,
    Forbidden,
    NotFound,
    VersionNotRoutable,
    StaleVersion,
    BodyTooLarge,
    StreamInterrupted,
    EngineUnavailable,
    NoReplica,
    AdapterCold,
    EngineRejected,
    TableStale,
)
"""Every refusal the data plane answers itself: its OpenAPI document is written from this tuple,
and tests/test_error_docs.py checks that the pipeline raises nothing else."""
_H_SESSION = SESSION_HEADER.lower().encode()


class Warmer(Protocol):
    """What places a cold version (``router.placement.Placer``; on a copy, ``sync.Syncer``):
    returns once this data plane's table lists a replica for it."""

    async def warm(self, name: str, version: int, more: bool = False) -> object: ...

    async def resolve(self, name: str) -> bool:
        """Whether ``name`` is in this data plane's table, after the control plane registered
        it from a watched directory if one holds it."""
        ...


UNKNOWN_TTL_S = 1.0
"""How long a name no watched directory held is not asked about again (a client that sends
many requests for a name that does not exist costs the control plane one look a second)."""


def _quiet(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a background load's failure is the control plane's log


class Gate(Protocol):
    """What a data-plane copy checks before it resolves a request (``sync.Syncer.admit``)."""

    async def admit(self, models: Iterable[object], session: str | None) -> None: ...


class Pipeline(Addressing):
    """The hot path over one alias table (``resolve``: what a request names, ``Addressing``)."""

    def __init__(
        self,
        table: TableView,
        balancer: Balancer,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        *,
        fresh: aiohttp.ClientSession | None = None,
        api_key: str | None = None,
        tenants: Tenants | None = None,
        shapes: Sequence[Shape] | None = None,
        gate: Gate | None = None,
        warmer: Warmer | None = None,
        cold_wait_s: float = 30.0,
        grow_at: int = 0,
    ) -> None:
        super().__init__(table, balancer)
        self.metrics = metrics
        self.upstream = Upstream(session, metrics, fresh)
        self.dispatch = Dispatch(SHAPES if shapes is None else shapes)
        self.live = LiveRequests()
        """Translated requests in flight, by ``rid``: what SGLang's abort ends (aborts.py)."""
        self.gate = gate
        """A data-plane copy's check that its table may be trusted (``sync.Syncer``)."""
        self.warmer = warmer
        self.cold_wait_s = cold_wait_s
        self.grow_at = grow_at
        self._growing: set[tuple[str | None, int | None]] = set()
        self._unknown: dict[str, float] = {}
        """Names the control plane found nowhere, until when (monotonic) not to ask again."""
        self._key = api_key or None
        self.tenants = tenants
        """With tenants, a tenant's token may name only its own adapters (``check_scope``)."""
        self._guarded = self._key is not None or tenants is not None

    # --- entry ---------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        t0 = time.perf_counter()
        try:
            tenant = (
                self._caller(scope) if self._key is not None or self.tenants is not None else None
            )
            body = await self._read_body(receive)
            doc = _json_object(body)
            session = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == _H_SESSION), None
            )
            shape = self.dispatch.shape(scope["path"], doc)
            await shape.handle(self, Call(scope, receive, send, body, doc, session, t0, tenant))
        except ServiceError as exc:
            await send_error(send, exc)

    def _caller(self, scope) -> Tenant | None:
        """The tenant whose token the request carries (None: the inference key's). Raises
        ``Unauthorized`` / ``Forbidden``; with tenants and no key, a token is required."""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if self.tenants is None:
            check_token(header, self._key, what="API key")
            return None
        return identify_caller(
            header, self._key, self.tenants, "API key", open_without_operator=False
        ).tenant

    @staticmethod
    async def _read_body(receive) -> bytes:
        msg = await receive()
        body = msg.get("body", b"")
        if not msg.get("more_body"):
            return body
        buf = bytearray(body)
        while msg.get("more_body"):
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise InvalidRequest("client went away")
            buf += msg.get("body", b"")
            if len(buf) > MAX_BODY:
                raise BodyTooLarge(f"body over {MAX_BODY} bytes")
        return bytes(buf)

    # --- what every shape shares ---------------------------------------------------------------

    async def admit(self, models: Iterable[object], session: str | None) -> None:
        """Before resolving ``models``: on a data-plane copy, wait until its table may be
        trusted (raises ``TableStale`` when it may not); nothing to wait for in one process."""
        if self.gate is not None:
            await self.gate.admit(models, session)
        if self.warmer is not None:
            deadline = time.monotonic() + self.cold_wait_s
            for model in models:
                if self._may_resolve(model):
                    await self._resolve(model, deadline)  # type: ignore[arg-type]
                # Until it has a holder: a version loaded for this request may be evicted again
                # before the request reaches it (a burst of other cold names on few slots).
                while (cold := self._cold(model, session)) is not None:
                    await self._warm(*cold, deadline)

    def _may_resolve(self, model: object) -> bool:
        """A valid adapter name this table does not know, nor any replica as a base model."""
        if not isinstance(model, str) or model in self.table.aliases or not is_valid_name(model):
            return False
        if self._unknown.get(model, 0.0) > time.monotonic():
            return False
        return model not in self.balancer.base_models()

    async def _resolve(self, name: str, deadline: float) -> None:
        """Ask the control plane to register ``name`` from a watched directory (bounded by
        ``deadline``); not found: remembered for ``UNKNOWN_TTL_S``, and the resolve that
        follows answers 404 as for any unknown name."""
        assert self.warmer is not None
        try:
            found = await asyncio.wait_for(
                self.warmer.resolve(name), max(0.05, deadline - time.monotonic())
            )
        except (TimeoutError, LorafleetError):
            found = False
        if not found:
            if len(self._unknown) > 4096:
                now = time.monotonic()
                self._unknown = {k: t for k, t in self._unknown.items() if t > now}
            self._unknown[name] = time.monotonic() + UNKNOWN_TTL_S

    def _grow(self, route: Route) -> None:
        """The replica picked for ``route`` has ``grow_at`` requests of its version in flight:
        ask the control plane, in the background, for one more replica to hold it."""
        key = route.key
        if self.warmer is None or route.adapter is None or route.version is None:
            return
        if key in self._growing:
            return
        self._growing.add(key)
        task = asyncio.ensure_future(self.warmer.warm(route.adapter, route.version, more=True))
        task.add_done_callback(lambda t: (self._growing.discard(key), _quiet(t)))

    def _cold(self, model: object, session: str | None) -> tuple[str, int] | None:
        """(name, version) when ``model`` resolves to a version no replica holds (a resolve
        error is the resolve's own to raise, later)."""
        entry = self.table.aliases.get(model) if isinstance(model, str) else None
        if entry is not None and (session is None or not entry.pins_sessions):
            # The common case, without a second full resolve: the name's newest version.
            ref = entry.window()[0]
            return None if ref.replicas else (entry.name, ref.version)
        try:
            route = self.resolve(model, session)
        except ServiceError:
            return None
        if route.adapter is None or route.version is None or route.replicas:
            return None
        return route.adapter, route.version

    async def _warm(self, name: str, version: int, deadline: float) -> None:
        """Have the control plane place a cold version, waiting until ``deadline`` (monotonic;
        ``cold_wait_s`` after the request arrived), trying again while it could not be placed.
        Raises ``AdapterCold`` (with ``Retry-After``) past that; a load under way goes on."""
        assert self.warmer is not None
        retry = f"{max(1, math.ceil(self.cold_wait_s or 1))}"
        last: Exception | None = None
        while True:
            # Asked at least once, even with no time to wait (``--cold-wait 0``): it loads on.
            task = asyncio.ensure_future(self.warmer.warm(name, version))
            try:
                await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
                return
            except TimeoutError:
                task.add_done_callback(_quiet)
            except (NotFound, VersionNotRoutable):
                return  # gone meanwhile: the resolve that follows says so
            except Exception as exc:  # it could not be placed now (no room, no answer)
                last = exc
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                why = f": {last}" if last is not None else ""
                raise AdapterCold(
                    f"{name!r} v{version} is placed on no replica and is being loaded; retry{why}",
                    headers={"Retry-After": retry},
                ) from last

    def candidates(self, route: Route) -> list[Replica]:
        """The replicas that may serve ``route``: routable ones, else every known holder (a
        replica that looks unhealthy beats a 503 without trying). Raises ``NoReplica``."""
        cands = self.balancer.candidates(route.replicas, route.base_model)
        if not cands:
            cands = self.balancer.known(route.replicas, route.base_model)
            if cands:
                self.metrics.panic.inc()
        if not cands:
            raise NoReplica(f"no replica serves {route.what!r} right now")
        return cands

    @contextlib.contextmanager
    def accounted(self, routes: Sequence[Route], t0: float) -> Iterator[Outcome]:
        """Count ``routes`` in flight (drains wait for them) for as long as the block runs, then
        record their latency, status and version lag. Enter it in the same tick as
        ``resolve``: no ``await`` in between."""
        for route in routes:
            self.balancer.begin(route.key)
        outcome = Outcome()
        try:
            yield outcome
        finally:
            spent = time.perf_counter() - t0
            for route in routes:
                self.balancer.end(route.key)
                hist, _ = self.metrics.children(*route.key)
                hist.observe(spent)
                self.metrics.count(route.adapter, route.version, outcome.status)
                if route.adapter is not None:
                    self.metrics.lag(route.adapter).observe(route.lag)

    async def post(self, replica: Replica, path: str, data: bytes) -> aiohttp.ClientResponse:
        """POST to one replica's engine; the answer counts as a sign of life. Raises
        ``Unreachable`` when nothing came back."""
        resp = await self.upstream.post(replica, path, data)
        self.balancer.succeeded(replica, probe=False)
        return resp

    async def attempt(
        self,
        route: Route,
        cands: list[Replica],
        session: str | None,
        run: Callable[[Replica, bool], Awaitable[T]],
    ) -> T:
        """``run(replica, may_hand_on)`` on one replica; once more on another if the first could
        not be reached (``Unreachable``) or handed the request on (``HandOn``, allowed only on
        the first try). Raises ``EngineUnavailable`` when no replica took it."""
        failed: Replica | None = None
        for _ in range(2):
            replica = self.balancer.pick(cands, session, exclude=failed)
            if replica is None:
                break
            self.balancer.sent(replica, route.key, 1)
            if self.grow_at and replica.by_key[route.key] >= self.grow_at:
                self._grow(route)
            placed_at = replica.agent_url
            try:
                return await run(replica, failed is None)
            except Unreachable as exc:
                # Refused means nothing listens: out of rotation at once. A timeout or a reset
                # counts as one failure; a run of them takes the replica out. Not if it was
                # re-placed meanwhile: that was its old address.
                if replica.agent_url == placed_at:
                    self.balancer.failed(replica, exc.detail, definitive=exc.refused, probe=False)
                self.metrics.retries.inc()
                failed = replica
            except HandOn:
                failed = replica
            finally:
                self.balancer.sent(replica, route.key, -1)
        raise EngineUnavailable(
            "could not connect to a replica" if failed else "no healthy replica right now"
        )

    def hand_on(
        self, replica: Replica, route: Route, status: int, body: bytes, cands: list[Replica]
    ) -> bool:
        """Whether a request goes on from ``replica`` to another candidate because its engine
        answered (``status``, ``body``) that it does not hold the version ``route`` names
        (``lacks_adapter`` of its kind). The table lists it for the version, yet the engine
        restarted empty, faster than the health poll could see: it leaves rotation until its
        agent says ready. With no other candidate, the engine's answer is relayed."""
        if (
            status < 400
            or route.engine_name is None
            or not any(c is not replica for c in cands)
            or not engine_kind(replica.kind).lacks_adapter(status, body)
        ):
            return False
        why = f"its engine does not hold {route.engine_name}"
        self.balancer.failed(replica, why, definitive=True, probe=False)
        self.metrics.retries.inc()
        return True

    async def _lacks_adapter(
        self, replica: Replica, resp: aiohttp.ClientResponse, route: Route, cands: list[Replica]
    ) -> bool:
        """``hand_on`` for an answer not read yet (its body is read only when it may be that;
        the read is cached, so it is relayed as is if it is not)."""
        if resp.status < 400 or route.engine_name is None:
            return False
        try:
            body = await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            return False
        return self.hand_on(replica, route, resp.status, body, cands)

    async def forward(self, call: Call, shape: ForwardShape, doc: dict[str, Any]) -> None:
        """Route one OpenAI-shaped request and relay its answer (``ForwardShape``)."""
        self.check_scope(call.tenant, doc.get("model"))
        await self.admit([doc.get("model")], call.session)
        route = self.resolve(doc.get("model"), call.session)
        cands = self.candidates(route)
        with self.accounted([route], call.t0) as outcome:
            stream = shape.stream(doc)
            run = self._forward(call, shape, doc, route, cands, stream)
            outcome.status = await (watched(run, call.receive) if stream else run)

    async def _forward(
        self,
        call: Call,
        shape: ForwardShape,
        doc: dict[str, Any],
        route: Route,
        cands: list[Replica],
        stream: bool,
    ) -> int:
        async def run(replica: Replica, may_hand_on: bool) -> int:
            up = shape.upstream(call, doc, route, replica)
            resp = await self.post(replica, up.path, up.data)
            try:
                if may_hand_on and await self._lacks_adapter(replica, resp, route, cands):
                    resp.release()
                    raise HandOn
            except HandOn:
                raise
            except BaseException:
                resp.close()
                raise
            try:
                ctype = resp.headers.get("Content-Type", "")
                if stream and resp.status == 200 and "text/event-stream" in ctype:
                    await relay_stream(call.send, route, replica, resp, call.path, up.sent_model)
                    return resp.status
                return await relay_whole(
                    call.send, route, replica, resp, up.sent_model, up.transform
                )
            except BaseException:
                resp.close()  # never return a half-read connection to the pool
                raise
            finally:
                resp.release()

        try:
            return await self.attempt(route, cands, call.session, run)
        except EngineUnavailable as exc:
            await send_error(call.send, exc)
            return exc.status


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"body is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise InvalidRequest("body must be a JSON object")
    return doc
