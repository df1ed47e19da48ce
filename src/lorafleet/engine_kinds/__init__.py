"""Engine kinds: what each kind of engine brings, in one registry.

An engine kind is one module here with one ``EngineKindInfo``: the agent's backend, the
rulebook its adapters are checked against, how an OpenAI request names an adapter on it, the
launch spec that starts one, and the facts the agent and the fleet act on. Everything that
dispatches on a kind (the agent, the router, the probe, the rules, ``lorafleet up``, Ray and the
front, which calls engines only through their backends) asks ``engine_kind(name)``. Adding a
kind: a module beside these, its name in ``EngineKind`` and one line in ``_KINDS``
(tests/test_engine_kinds.py checks the two agree).

Imports are lazy (inside the info's callables), so reading the registry costs no backend,
rulebook or launcher import: the router and the publisher stay light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

from lorafleet.protocol.agent import EngineKind

PrefixCacheResult = Literal["reset", "no_prefix_cache", "not_exposed", "refused", "unreachable"]


@dataclass(frozen=True)
class PrefixCacheReset:
    """What one engine did with a prefix-cache reset. ``result``: ``reset``; ``no_prefix_cache``
    (the kind keeps none); ``not_exposed`` (the kind has the route, this server does not expose
    it); ``refused`` (any other answer); ``unreachable`` (no answer). ``detail``: why, in words
    (the engine's answer for ``refused``), None for ``reset`` and ``no_prefix_cache``."""

    result: PrefixCacheResult
    detail: str | None = None


@dataclass(frozen=True)
class EngineReply:
    """An engine's answer to a LoRA-agnostic call (``/tokenize``), to relay as it came."""

    status_code: int
    content: bytes
    media_type: str


class EngineBackend(Protocol):
    """What ``make_backend`` returns (``lorafleet.agent.backends.base.EngineBackend``): the
    driver for one engine through its public API: the agent's runtime LoRA calls, and the
    LoRA-agnostic calls the front makes (models, prefix cache, tokenizer)."""

    kind: str
    url: str

    async def probe(self) -> Any: ...
    async def list_adapters(self) -> dict[str, str]: ...
    async def load(self, name: str, path: str, *, replace: bool = False) -> None: ...
    async def unload(self, name: str) -> None: ...
    async def models(self, *, timeout: float = 5.0) -> list[dict[str, Any]]: ...
    async def base_card(self, *, timeout: float = 5.0) -> dict[str, Any]: ...
    async def reset_prefix_cache(self, reset_running_requests: bool) -> PrefixCacheReset: ...
    async def tokenize(self, body: dict[str, Any]) -> EngineReply: ...
    async def detokenize(self, body: dict[str, Any]) -> EngineReply: ...
    async def next_token_logprobs(
        self, base_model: str, engine_name: str | None, prompt_ids: list[int], k: int
    ) -> dict[int, float]: ...
    async def aclose(self) -> None: ...


class Rulebook(Protocol):
    """What ``rulebook()`` returns (``lorafleet.rules.Rulebook``)."""

    kind: str

    def check(self, facts: Any, limits: Any = None) -> list[Any]: ...


class ServerSpec(Protocol):
    """What ``spec_class()`` builds (a ``lorafleet.launch`` spec): where a server listens."""

    host: str
    port: int
    name: str


__all__ = [
    "ENGINE_KINDS",
    "EngineBackend",
    "EngineKind",
    "EngineKindInfo",
    "EngineOption",
    "EngineReply",
    "PrefixCacheReset",
    "PrefixCacheResult",
    "address",
    "engine_kind",
    "model_field",
]


@dataclass(frozen=True)
class EngineOption:
    """An agent flag only one engine kind has (``--sglang-upsert``): a boolean, off by default.

    ``key`` is its name in ``AgentConfig.engine_options``; ``param`` the backend's keyword.
    """

    key: str
    flag: str
    help: str
    param: str


@dataclass(frozen=True)
class EngineKindInfo:
    """One engine kind. ``backend``, ``rules`` and ``launch_spec`` are ``"module:attribute"``
    references (imported on first use): the agent's backend class, the rulebook, and the
    ``ServerSpec`` class that starts one (it takes ``model=``)."""

    name: str
    title: str
    backend: str
    rules: str
    launch_spec: str
    adapter_in_model: Callable[[str | None, str], str] = lambda _base, engine_name: engine_name
    """The ``model`` value that makes this engine apply ``engine_name`` (given the base name)."""
    embedded: bool = False
    """lorafleet can start this engine itself with no model given (``lorafleet up``)."""
    links_in_place: bool = False
    """An in-place load goes through a link the agent repoints: the engine re-reads a name's
    remembered path after an unload (SGLang)."""
    options: tuple[EngineOption, ...] = field(default=())
    lacks_adapter: Callable[[int, bytes], bool] = lambda status, _body: status == 404
    """Whether an engine's error answer (status, body) to a generation request says it does
    not hold the adapter it was asked for (vLLM: 404). The router then tries a replica that
    does: the table can be a health poll behind an engine that restarted empty."""
    canary_tolerance: float = 0.5
    """The largest |engine - trainer| next-token log-probability (nats) on the canary that this
    kind's engine reaches for a correctly applied adapter (``lorafleet.protocol.canary``):
    kernels and dtypes differ from the trainer's; measured per kind, bench/RESULTS.md."""
    native_routes: frozenset[str] = frozenset()
    """Generation routes of lorafleet's data plane this engine serves itself, in the same shape
    (vLLM: ``/inference/v1/generate``; SGLang: ``/generate``); elsewhere the data plane
    translates them to ``/v1/completions`` and back."""
    completion_fields: frozenset[str] = frozenset()
    """Sampling fields beyond OpenAI's own that this engine's ``/v1/completions`` honours
    (vLLM's ``top_k``, ``min_p``...): a translated request may use them; any other is refused
    by name unless it has its default value."""
    abort_route: str | None = None
    """Where the engine aborts a request by its ``rid`` (SGLang: ``/abort_request``); None: the
    data plane ends the upstream request itself."""

    def make_backend(
        self,
        url: str,
        *,
        max_lora_rank: int | None = None,
        max_adapters: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> EngineBackend:
        """The agent's backend for an engine of this kind at ``url``."""
        given = options or {}
        extra = {o.param: bool(given.get(o.key)) for o in self.options if given.get(o.key)}
        cls = _resolve(self.backend)
        return cls(url, max_lora_rank=max_lora_rank, max_adapters=max_adapters, **extra)

    def rulebook(self) -> Rulebook:
        """The rules an adapter must pass on this kind (``lorafleet.rules``)."""
        return _resolve(self.rules)

    def spec_class(self) -> type[ServerSpec]:
        """The ``lorafleet.launch`` spec that starts an engine of this kind."""
        return _resolve(self.launch_spec)


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _kinds() -> dict[str, EngineKindInfo]:
    from lorafleet.engine_kinds import reference, sglang, vllm

    return {k.name: k for k in (vllm.KIND, sglang.KIND, reference.KIND)}


_KINDS: dict[str, EngineKindInfo] | None = None
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)


def engine_kind(name: str) -> EngineKindInfo:
    """The registry's entry for ``name``. Raises ``ValueError`` for an unknown kind."""
    global _KINDS
    if _KINDS is None:
        _KINDS = _kinds()
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown engine kind {name!r}; one of {list(ENGINE_KINDS)}") from None


def all_options() -> tuple[tuple[EngineKindInfo, EngineOption], ...]:
    """Every kind's own agent flags, with the kind that owns each."""
    return tuple((engine_kind(k), o) for k in ENGINE_KINDS for o in engine_kind(k).options)


def model_field(kind: str, base_model: str | None, engine_name: str | None) -> str | None:
    """The ``model`` value that makes an engine of ``kind`` apply ``engine_name`` (None: base)."""
    if engine_name is None:
        return base_model
    return engine_kind(kind).adapter_in_model(base_model, engine_name)


def address(
    body: dict[str, Any], kind: str, base_model: str | None, engine_name: str | None
) -> dict[str, Any]:
    """A copy of an OpenAI request ``body`` addressed to ``engine_name`` on an engine of ``kind``.

    With ``engine_name`` None (a base-model request) the client's ``model`` stays as sent. A
    client's own ``lora_path`` is always dropped: on SGLang it would pick another adapter than
    the one the response is tagged with.
    """
    out = {k: v for k, v in body.items() if k != "lora_path"}
    if engine_name is not None:
        out["model"] = model_field(kind, base_model, engine_name)
    return out
