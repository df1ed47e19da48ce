"""The one interface lorafleet uses to drive an engine, and the errors a backend raises.

A backend speaks only the engine's public API: the runtime LoRA calls the agent makes, and the
LoRA-agnostic calls the front makes (``models``, ``reset_prefix_cache``, ``tokenize``), so no
route or answer of an engine is known outside its kind's backend. It translates the engine's
answers into three outcomes: ``EngineUnavailable`` (no answer: protocol code
``engine_unavailable``, 503), ``EngineRejected`` (the engine refused: ``engine_rejected``, 502,
carrying the engine's message) and ``AdapterMissing`` (the engine does not know the name; unload
treats it as already done). The first two are ``lorafleet.errors`` classes, so they reach the
agent's clients as they are. A prefix-cache reset never raises: its outcome is a
``PrefixCacheReset``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from lorafleet._http import async_client, error_message
from lorafleet.engine_kinds import EngineReply, PrefixCacheReset, model_field
from lorafleet.errors import EngineRejected, EngineUnavailable, LorafleetError
from lorafleet.protocol.agent import EngineCapabilities

__all__ = [
    "AdapterMissing",
    "EngineBackend",
    "EngineProbe",
    "EngineRejected",
    "EngineReply",
    "EngineUnavailable",
    "PrefixCacheReset",
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

    @abstractmethod
    async def reset_prefix_cache(self, reset_running_requests: bool) -> PrefixCacheReset:
        """Empty the engine's prefix cache (``reset_running_requests``: also the cache of the
        requests in flight, where the kind tells them apart). Never raises."""

    async def models(self, *, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The cards ``GET /v1/models`` lists (each has an ``id``; an adapter's has a ``parent``).
        Raises ``EngineUnavailable``."""
        with map_transport(self.url):
            r = await self.http.get("/v1/models", timeout=timeout)
        if r.status_code != 200:
            raise EngineUnavailable(f"GET /v1/models answered {r.status_code}: {error_message(r)}")
        data = json_dict(r).get("data")
        if not isinstance(data, list):
            raise EngineUnavailable(f"GET /v1/models answered no model list: {r.text[:200]!r}")
        return [c for c in data if isinstance(c, dict) and "id" in c]

    async def base_card(self, *, timeout: float = 5.0) -> dict[str, Any]:
        """The base model's card in ``/v1/models`` (the first without a ``parent``: id, root,
        max_model_len where the engine says). Raises ``EngineUnavailable``."""
        for card in await self.models(timeout=timeout):
            if not card.get("parent"):
                return card
        raise EngineUnavailable("engine lists no base model in /v1/models")

    async def tokenize(self, body: dict[str, Any]) -> EngineReply:
        """``POST /tokenize`` (vLLM's body; SGLang answers the same route), relayed as it came.
        Raises ``EngineUnavailable`` when the engine does not answer."""
        return await self._relay("/tokenize", body)

    async def detokenize(self, body: dict[str, Any]) -> EngineReply:
        """``POST /detokenize`` -> ``{"prompt"}`` (vLLM's answer), relayed as it came. Raises
        ``EngineUnavailable`` when the engine does not answer."""
        return await self._relay("/detokenize", body)

    async def next_token_logprobs(
        self, base_model: str, engine_name: str | None, prompt_ids: list[int], k: int
    ) -> dict[int, float]:
        """The top-``k`` next-token log-probabilities after ``prompt_ids`` (token id -> value),
        greedy, addressed as the router addresses ``engine_name`` (None: the base). OpenAI's
        ``/v1/completions`` with vLLM's ``return_tokens_as_token_ids``; a sampled token's top-k
        goes through the engine's normal path, safe under live traffic (``agent/probe.py``).
        Raises ``EngineUnavailable`` (no answer) or ``EngineRejected``."""
        body = {
            "model": model_field(self.kind, base_model, engine_name),
            "prompt": prompt_ids,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": k,
            "return_tokens_as_token_ids": True,
        }
        with map_transport(self.url):
            r = await self.http.post("/v1/completions", json=body, timeout=60.0)
        if r.status_code != 200:
            raise EngineRejected(f"/v1/completions answered {r.status_code}: {error_message(r)}")
        try:
            top = json_dict(r)["choices"][0]["logprobs"]["top_logprobs"][0]
            return {int(t.removeprefix("token_id:")): float(v) for t, v in top.items()}
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            why = f"/v1/completions answered no top logprobs: {r.text[:200]}"
            raise EngineRejected(why) from exc

    async def _relay(self, route: str, body: dict[str, Any]) -> EngineReply:
        with map_transport(self.url):
            r = await self.http.post(route, json=body, timeout=60.0)
        return EngineReply(
            r.status_code, r.content, r.headers.get("content-type", "application/json")
        )

    async def _post_reset(
        self, route: str, params: dict[str, str], *, not_exposed: str | None = None
    ) -> PrefixCacheReset:
        """POST ``route``: 200 is ``reset``, no answer ``unreachable``. A 404 is ``not_exposed``
        (with ``not_exposed`` as its detail) where the kind's servers may hide the route, else
        ``refused`` like any other answer."""
        try:
            r = await self.http.post(route, params=params, timeout=30.0)
        except httpx.HTTPError as exc:
            return PrefixCacheReset("unreachable", str(exc))
        if r.status_code == 404 and not_exposed is not None:
            return PrefixCacheReset("not_exposed", not_exposed)
        if r.status_code != 200:
            return PrefixCacheReset("refused", r.text[:500])
        return PrefixCacheReset("reset")
