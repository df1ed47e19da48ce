"""The one interface the agent uses to drive an engine, and the errors a backend raises.

A backend speaks only the engine's public runtime API. It translates the engine's answers into
three outcomes: ``EngineUnavailable`` (no answer: protocol code ``engine_unavailable``, 503),
``EngineRejected`` (the engine refused: ``engine_rejected``, 502, carrying the engine's message)
and ``AdapterMissing`` (the engine does not know the name; unload treats it as already done).
The first two are ``lorafleet.errors`` classes, so they reach the agent's clients as they are.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from lorafleet._http import async_client, error_message
from lorafleet.errors import EngineRejected, EngineUnavailable, LorafleetError
from lorafleet.protocol.agent import EngineCapabilities

__all__ = [
    "AdapterMissing",
    "EngineBackend",
    "EngineProbe",
    "EngineRejected",
    "EngineUnavailable",
    "json_dict",
]


class AdapterMissing(LorafleetError):
    """The engine has no adapter under that name."""


@dataclass
class EngineProbe:
    """What the agent learns about the engine at startup."""

    base_model: str
    capabilities: EngineCapabilities


@contextlib.contextmanager
def map_transport(url: str) -> Iterator[None]:
    """httpx's no-response errors become ``EngineUnavailable``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise EngineUnavailable(
            f"engine at {url} unreachable: {type(exc).__name__}: {exc}"
        ) from exc


def json_dict(resp: httpx.Response) -> dict:
    """The response's JSON object, or ``{}`` when the body is not JSON or not an object."""
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class EngineBackend(ABC):
    """Load, unload and list adapters on one engine. One instance per agent."""

    kind: str

    def __init__(self, url: str, *, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.http = async_client(base_url=self.url, timeout=timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    @abstractmethod
    async def probe(self) -> EngineProbe:
        """Learn the base model and limits. Raises ``EngineUnavailable``."""

    @abstractmethod
    async def list_adapters(self) -> dict[str, str]:
        """Adapters the engine holds now: engine name -> path. Raises ``EngineUnavailable``."""

    @abstractmethod
    async def load(self, name: str, path: str, *, replace: bool = False) -> None:
        """Register ``path`` under ``name``; ``replace`` upserts an existing name."""

    @abstractmethod
    async def unload(self, name: str) -> None:
        """Remove ``name``. Raises ``AdapterMissing`` if the engine does not know it."""

    async def _models(self) -> list[dict]:
        with map_transport(self.url):
            r = await self.http.get("/v1/models", timeout=5.0)
        if r.status_code != 200:
            raise EngineUnavailable(f"GET /v1/models answered {r.status_code}: {error_message(r)}")
        data = json_dict(r).get("data")
        if not isinstance(data, list):
            raise EngineUnavailable(f"GET /v1/models answered no model list: {r.text[:200]!r}")
        return [c for c in data if isinstance(c, dict) and "id" in c]
