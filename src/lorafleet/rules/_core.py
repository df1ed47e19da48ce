"""The rulebook machinery: what a rule looks at, what it reports, and how rules combine."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "AdapterFacts",
    "EngineLimits",
    "Finding",
    "Problem",
    "Rule",
    "Rulebook",
    "Stage",
    "shared_rulebook",
]


class Stage:
    """When an engine checks a rule, in vLLM 0.32's load order (SGLang's follows it closely).

    An engine stops at the first stage that refuses, so an imitation of it reports only that
    stage; lorafleet's own validation reports every stage at once.
    """

    REQUIRED_KEYS = 10  # PEFTHelper.from_dict
    PEFT_TYPE = 15
    RANK = 20  # PEFTHelper.__post_init__: r
    RANK_PATTERN = 21  # ... then each rank_pattern value
    FEATURES = 30  # PEFTHelper.validate_legal: features, max rank, bias (one joined message)
    WEIGHT_FILES = 40  # LoRAModel.from_local_checkpoint: which file holds the tensors
    TENSOR_NAMES = 50  # parse_fine_tuned_lora_name: the first unsupported name
    TENSOR_MODULES = 51  # check_unexpected_modules: every module the model cannot adapt
    TENSOR_SHAPES = 55
    FULL_MODULES = 60  # _validate_modules_to_save: full copies of modules


@dataclass(frozen=True)
class AdapterFacts:
    """What the rules look at: an adapter's config and, when known, its tensors.

    ``tensors`` maps each tensor name to its shape; None when they are unknown (a ``.bin``
    without torch, or an engine that checks the config before it reads any weights).
    ``weight_files`` are the weight files present; ``path`` and ``name`` only fill messages.
    """

    config: Mapping[str, Any]
    tensors: Mapping[str, Sequence[int]] | None = None
    weight_files: tuple[str, ...] = ("adapter_model.safetensors",)
    path: str = "<adapter>"
    name: str = "adapter"


@dataclass(frozen=True)
class EngineLimits:
    """What the serving engine allows, when known: its max LoRA rank, the modules it can adapt."""

    max_rank: int | None = None
    supported_modules: frozenset[str] | None = None


class Finding(NamedTuple):
    """What one check reports: lorafleet's words, and the engine's own where it refuses itself."""

    message: str
    engine_message: str | None = None


@dataclass(frozen=True)
class Problem:
    """One reason an engine kind cannot serve an adapter as it was trained.

    ``message`` is lorafleet's operator-facing wording. ``engine_message`` is the engine's own
    refusal text where the engine refuses the adapter itself (the reference engine answers
    with it); None where the engine would accept the adapter and serve it wrong, so only
    lorafleet refuses it.
    """

    rule: str
    message: str
    engine_message: str | None = None
    stage: int = 0

    def __str__(self) -> str:
        return self.message


Check = Callable[[AdapterFacts, EngineLimits, str], Iterable[Finding]]


@dataclass(frozen=True)
class Rule:
    """One rule: a stable ``key`` (the same topic across rulebooks), a stage and a check.

    ``check(facts, limits, who)`` yields findings; ``who`` names the engine in messages.
    """

    key: str
    stage: int
    check: Check = field(repr=False)

    def evaluate(self, facts: AdapterFacts, limits: EngineLimits, who: str) -> list[Problem]:
        return [
            Problem(self.key, f.message, f.engine_message, self.stage)
            for f in self.check(facts, limits, who)
        ]


@dataclass(frozen=True)
class Rulebook:
    """The rules of one engine kind, in the order that engine checks them."""

    kind: str
    who: str
    source: str
    rules: tuple[Rule, ...]

    def __post_init__(self) -> None:
        keys = [r.key for r in self.rules]
        if len(keys) != len(set(keys)):
            raise ValueError(f"rulebook {self.kind!r} has a rule key twice: {keys}")

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(r.key for r in self.rules)

    def rule(self, key: str) -> Rule | None:
        """The rule for ``key``, or None if this engine kind has no such rule."""
        return next((r for r in self.rules if r.key == key), None)

    def check(self, facts: AdapterFacts, limits: EngineLimits | None = None) -> list[Problem]:
        """Every problem, ordered by stage (stable within a stage: the book's order)."""
        limits = limits or EngineLimits()
        problems = [p for rule in self.rules for p in rule.evaluate(facts, limits, self.who)]
        return sorted(problems, key=lambda p: p.stage)


def _all_refuse(variants: Sequence[Rule]) -> Check:
    """A check that finds a problem only when every variant does; in the first one's words."""
    if all(v is variants[0] for v in variants):  # lorafleet's own rules: one rule in every book
        variants = variants[:1]

    def check(facts: AdapterFacts, limits: EngineLimits, who: str) -> Iterable[Finding]:
        first = variants[0].evaluate(facts, limits, who)
        if first and all(v.evaluate(facts, limits, who) for v in variants[1:]):
            return [Finding(p.message) for p in first]  # no one engine's words
        return ()

    return check


def shared_rulebook(books: Sequence[Rulebook], *, who: str = "any engine") -> Rulebook:
    """The rules every book shares: a topic is refused when every engine kind refuses it.

    A rule whose key is missing from any book is dropped: some engine kind accepts it.
    """
    rules = []
    for rule in books[0].rules:
        variants = [v for v in (b.rule(rule.key) for b in books) if v is not None]
        if len(variants) == len(books):
            rules.append(Rule(rule.key, rule.stage, _all_refuse(variants)))
    source = "what every engine kind refuses (" + ", ".join(b.kind for b in books) + ")"
    return Rulebook("shared", who, source, tuple(rules))
