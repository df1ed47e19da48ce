"""What a generation shape is: a route, its body model, and how it maps to engines and back."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from lorafleet.dataplane.aborts import LiveRequests
from lorafleet.dataplane.addressing import Route, TableView
from lorafleet.dataplane.balancer import Replica
from lorafleet.errors import InvalidRequest
from lorafleet.protocol.tenants import Tenant

__all__ = ["Call", "ForwardShape", "HandOn", "Outcome", "Pipe", "Shape", "Upstream", "parse"]

T = TypeVar("T")


class HandOn(Exception):
    """A replica's engine said it does not hold the version: the request goes to another."""


class Outcome:
    """The status a request ended with, as the metrics count it (0: it never answered)."""

    __slots__ = ("status",)

    def __init__(self) -> None:
        self.status = 0


@dataclass(slots=True)
class Call:
    """One request as it arrived: the ASGI channels, its bytes and JSON object, its session."""

    scope: dict
    receive: Callable
    send: Callable
    body: bytes
    doc: dict[str, Any]
    session: str | None
    t0: float
    """When it arrived (``perf_counter``): latency is measured from here."""
    tenant: Tenant | None = None
    """Whose token it carried: a tenant (it may name only its own adapters), or None, the
    operator's inference key or an open data plane."""

    @property
    def path(self) -> str:
        return self.scope["path"]


@dataclass(frozen=True, slots=True)
class Upstream:
    """What one replica is sent for a request, and how its 200 JSON answer comes back."""

    path: str
    data: bytes
    sent_model: str | None
    """The ``model`` the engine sees (scrubbed from its errors, renamed in its answer)."""
    transform: Callable[[bytes], bytes] | None = None
    """Rebuilds the engine's answer in the client's shape (None: relayed as it is)."""


class Pipe(Protocol):
    """What a shape may ask of the pipeline (``pipeline.Pipeline``)."""

    table: TableView
    live: LiveRequests

    def check_scope(self, tenant: Tenant | None, model: object) -> None: ...
    async def admit(self, models: Iterable[object], session: str | None) -> None: ...
    def resolve(self, model: object, session: str | None = None) -> Route: ...
    def candidates(self, route: Route) -> list[Replica]: ...
    def accounted(
        self, routes: Sequence[Route], t0: float
    ) -> contextlib.AbstractContextManager[Outcome]: ...
    async def post(self, replica: Replica, path: str, data: bytes) -> aiohttp.ClientResponse: ...
    async def attempt(
        self,
        route: Route,
        cands: list[Replica],
        session: str | None,
        run: Callable[[Replica, bool], Awaitable[T]],
    ) -> T: ...
    def hand_on(
        self, replica: Replica, route: Route, status: int, body: bytes, cands: list[Replica]
    ) -> bool: ...
    async def forward(self, call: Call, shape: ForwardShape, doc: dict[str, Any]) -> None: ...


class Shape(ABC):
    """One generation route (see the module docstring)."""

    path: ClassVar[str]
    summary: ClassVar[str]
    model: ClassVar[type[BaseModel]]
    """The request body: validates it (where the shape reads it) and documents it."""
    streams: ClassVar[bool] = False
    """Whether ``stream: true`` answers with server-sent events."""

    def accepts(self, doc: dict[str, Any]) -> bool:
        """Whether this shape answers ``doc`` (two shapes share ``/generate``)."""
        return True

    @abstractmethod
    async def handle(self, pipe: Pipe, call: Call) -> None:
        """Answer ``call``. A ``ServiceError`` raised before anything is sent becomes the
        protocol's error answer."""


class ForwardShape(Shape):
    """One prompt, one route, one replica (another, once, if the first cannot take it)."""

    def prepare(self, call: Call) -> dict[str, Any]:
        """The body to route (validated); raises ``InvalidRequest`` (400)."""
        return call.doc

    def stream(self, doc: dict[str, Any]) -> bool:
        return self.streams and doc.get("stream") is True

    @abstractmethod
    def upstream(self, call: Call, doc: dict[str, Any], route: Route, replica: Replica) -> Upstream:
        """What ``replica`` is sent, in its engine's dialect."""

    async def handle(self, pipe: Pipe, call: Call) -> None:
        doc = self.prepare(call)
        await pipe.forward(call, self, doc)


def parse(model: type[BaseModel], doc: dict[str, Any]) -> BaseModel:
    """``doc`` validated by ``model``; the first problem as a 400 naming its field."""
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        # Union members name themselves in the location (``SamplingParams``): not a field.
        loc = ".".join(
            str(p) for p in first.get("loc", ()) if not (isinstance(p, str) and p[:1].isupper())
        )
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        raise InvalidRequest(f"{loc}: {msg}" if loc else msg, param=loc or None) from None
