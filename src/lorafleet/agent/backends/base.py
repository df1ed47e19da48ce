"""The one interface the agent uses to drive an engine, and the errors a backend raises.

A backend speaks only the engine's public runtime API. It translates the engine's answers into
three outcomes the agent maps to protocol errors: ``EngineUnavailable`` (no answer, 503),
``EngineRejected`` (the engine refused, 502, carrying its message) and ``AdapterMissing``
(the engine does not know the name; unload treats it as already done).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from lorafleet.protocol.agent import EngineCapabilities

__all__ = [
    "AdapterMissing",
    "EngineBackend",
    "EngineError",
    "EngineProbe",
    "EngineRejected",
    "EngineUnavailable",
    "json_dict",
]


class EngineError(Exception):
    """Base of backend errors."""


class EngineUnavailable(EngineError):
    """The engine did not answer (refused, reset, timed out) or is not set up for runtime LoRA."""


class EngineRejected(EngineError):
    """The engine answered and refused the operation; ``message`` is the engine's own text."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class AdapterMissing(EngineError):
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


def error_text(resp: httpx.Response) -> str:
    """The engine's message from vLLM's envelope, SGLang's body, FastAPI's detail, or text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("error_message", "message", "detail"):
            if body.get(key):
                return str(body[key])
    return resp.text.strip()


class EngineBackend(ABC):
    """Load, unload and list adapters on one engine. One instance per agent."""

    kind: str

    def __init__(self, url: str, *, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout)

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
            raise EngineUnavailable(f"GET /v1/models answered {r.status_code}: {error_text(r)}")
        data = json_dict(r).get("data")
        if not isinstance(data, list):
            raise EngineUnavailable(f"GET /v1/models answered no model list: {r.text[:200]!r}")
        return [c for c in data if isinstance(c, dict) and "id" in c]
