"""The canary: proof that a replica computes what the trainer computed, not only "not the base".

The trainer (``lorafleet.publisher.canary``) runs a few fixed prompts through its own model
with the adapter and with it disabled, and sends, per prompt, the next-token log-probabilities
of a handful of tokens under both (``Canary``). Before the flip each agent asks its engine for the
next-token top-k log-probabilities of the same prompts, addressed as the router addresses the
adapter, and ``judge`` compares.

The rule (``judge``), per publication and replica, over every (prompt, token) of the canary:

- ``mean_vs_trainer`` = mean |engine - trainer|, ``mean_vs_base`` = mean |engine - base|;
- **passed** when ``mean_vs_trainer <= RATIO * mean_vs_base`` (the engine is at least
  ``1 / RATIO`` times closer to the trainer's adapter than to the base: a relative test, so a bf16
  engine's noise does not matter while the adapter moves the canary more than that noise) **and**
  ``max_vs_trainer <= tolerance`` (the engine kind's absolute tolerance, ``engine_kinds``);
- **uninformative** when the adapter barely moves the canary at the trainer (mean |trainer -
  base| under ``MIN_SHIFT``): nothing can be told apart, and the verdict says so (never a refusal);
- **failed** otherwise, with the figures.

A token outside the engine's top-k answer has a log-probability at most the engine's lowest listed
value; it counts with the least difference that allows (0 for a value below it), so a missing
token never makes a difference up, and a token the engine should list but does not still counts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CANARY_TOP_K",
    "MIN_SHIFT",
    "RATIO",
    "Canary",
    "CanaryPrompt",
    "CanaryVerdict",
    "judge",
]

RATIO = 0.25
"""The engine must be at least 4 times closer to the trainer's adapter than to the base."""
MIN_SHIFT = 0.01
"""Below this mean |trainer - base| (nats), the canary cannot tell the adapter from the base."""
CANARY_TOP_K = 20
"""How many next-token log-probabilities an agent asks its engine for (vLLM's default cap)."""

Outcome = Literal["passed", "failed", "uninformative"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CanaryPrompt(_Model):
    """One prompt and, for each of ``tokens``, its next-token log-probability after the prompt
    under the trainer's adapter (``trainer``) and under the base model (``base``)."""

    prompt_ids: list[int] = Field(min_length=1, max_length=4096)
    tokens: list[int] = Field(min_length=1, max_length=64)
    trainer: list[float] = Field(min_length=1, max_length=64)
    base: list[float] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _aligned(self) -> CanaryPrompt:
        if not len(self.tokens) == len(self.trainer) == len(self.base):
            raise ValueError("tokens, trainer and base must have one entry per token")
        if min(self.prompt_ids) < 0 or min(self.tokens) < 0:
            raise ValueError("token ids are non-negative")
        if any(v > 1e-6 or v != v for v in (*self.trainer, *self.base)):
            raise ValueError("log-probabilities are finite and at most 0")
        return self


class Canary(_Model):
    """What the trainer computed, sent with a publication (``Publisher.publish(canary=...)``)."""

    prompts: list[CanaryPrompt] = Field(min_length=1, max_length=32)


class CanaryVerdict(_Model):
    """How one replica's engine answered the canary (kept on the agent's record and in the
    publication's result)."""

    outcome: Outcome
    mean_vs_trainer: float
    max_vs_trainer: float
    mean_vs_base: float
    max_vs_base: float
    tolerance: float
    detail: str


def judge(canary: Canary, answers: list[dict[int, float]], tolerance: float) -> CanaryVerdict:
    """The verdict on an engine whose next-token top-k for prompt i is ``answers[i]``."""
    if len(answers) != len(canary.prompts):
        raise ValueError(f"{len(answers)} answers for {len(canary.prompts)} canary prompts")
    vs_trainer: list[float] = []
    vs_base: list[float] = []
    shift: list[float] = []
    for prompt, top in zip(canary.prompts, answers, strict=True):
        if not top:
            raise ValueError("an engine answer lists no log-probabilities")
        floor = min(top.values())
        for token, t, b in zip(prompt.tokens, prompt.trainer, prompt.base, strict=True):
            e = top.get(token)
            if e is None:
                # Not listed: its value is at most ``floor``; the least |Δ| that allows.
                vs_trainer.append(max(0.0, t - floor))
                vs_base.append(max(0.0, b - floor))
            else:
                vs_trainer.append(abs(e - t))
                vs_base.append(abs(e - b))
            shift.append(abs(t - b))
    n = len(vs_trainer)
    mt, mb, ms = sum(vs_trainer) / n, sum(vs_base) / n, sum(shift) / n
    figures = {
        "mean_vs_trainer": mt,
        "max_vs_trainer": max(vs_trainer),
        "mean_vs_base": mb,
        "max_vs_base": max(vs_base),
        "tolerance": tolerance,
    }
    said = (
        f"mean |Δ log p| {mt:.3g} against the trainer, {mb:.3g} against the base "
        f"(max {figures['max_vs_trainer']:.3g}; the adapter moves the canary by {ms:.3g})"
    )
    if ms < MIN_SHIFT:
        return CanaryVerdict(
            outcome="uninformative",
            detail=f"the adapter barely moves the canary at the trainer ({ms:.3g}): {said}",
            **figures,
        )
    if mt <= RATIO * mb and figures["max_vs_trainer"] <= tolerance:
        return CanaryVerdict(outcome="passed", detail=said, **figures)
    why = (
        f"not {1 / RATIO:.0f}x closer to the trainer than to the base"
        if mt > RATIO * mb
        else f"max over the kind's tolerance {tolerance:.3g}"
    )
    return CanaryVerdict(outcome="failed", detail=f"{why}: {said}", **figures)
