"""Rule factories. Each makes one rule; the engine modules choose them and their wording.

``words`` arguments give the engine's own refusal text: a string, a function of the facts (for
messages that name the adapter or its path), or None where the engine does not refuse by itself.
Rules skip absent values, which ``required_keys`` reports (an absent ``r`` is not also a bad one).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from lorafleet.rules._core import AdapterFacts, EngineLimits, Finding, Rule, Stage
from lorafleet.rules._peft import (
    declared_rank,
    is_positive_int,
    parse_lora_key,
    pattern_value,
    strip_prefix,
    targets_module,
)

__all__ = [
    "BIN",
    "HEADS",
    "PLAIN_INITS",
    "SAFETENSORS",
    "alpha_pattern_ignored",
    "both_weight_files",
    "feature",
    "full_modules",
    "init_lora_weights",
    "lora_pairs",
    "max_rank",
    "modules_to_save",
    "no_weights",
    "peft_type",
    "rank_pattern",
    "rank_r",
    "required_keys",
    "rslora_ignored",
    "supported_modules",
    "target_modules_string",
    "tensor_names",
    "tensor_targets",
]

SAFETENSORS = "adapter_model.safetensors"
BIN = "adapter_model.bin"
REQUIRED = ("r", "lora_alpha", "target_modules")
# Inits that only set the adapter's starting weights: a saved adapter is a plain LoRA. The others
# (PiSSA, OLoRA, CorDA, LoftQ) assume base weights that PEFT modifies when it loads the adapter.
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
# Full copies of modules (modules_to_save) that vLLM loads, into a classification head only.
HEADS = ("classifier", "score")

Words = str | Callable[[AdapterFacts], str] | None


def _say(words: Words, facts: AdapterFacts) -> str | None:
    return words(facts) if callable(words) else words


def _lora_keys(facts: AdapterFacts) -> Iterable[tuple[str, str, str]]:
    """(tensor name, module, "A"|"B") for every LoRA tensor."""
    for key in facts.tensors or {}:
        parsed = parse_lora_key(key)
        if parsed is not None:
            yield key, *parsed


def _full_module(key: str, facts: AdapterFacts) -> str | None:
    """The module a full-module tensor (``<...>.<module>.weight``/``.bias``) copies, if the
    config lists it in ``modules_to_save``."""
    parts = key.split(".")
    mts = facts.config.get("modules_to_save") or ()
    if len(parts) >= 2 and parts[-1] in ("weight", "bias") and parts[-2] in mts:
        return parts[-2]
    return None


# --- the config ----------------------------------------------------------------------------------


def required_keys(*, engine_words: bool) -> Rule:
    """r, lora_alpha and target_modules must be set (vLLM: ``PEFTHelper.from_dict``)."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        missing = [k for k in REQUIRED if f.config.get(k) in (None, "", [])]
        if missing:
            absent = set(REQUIRED) - set(f.config)
            words = f"Missing required configuration fields: {absent}" if absent else None
            yield Finding(
                f"adapter config is missing required keys: {', '.join(missing)}",
                words if engine_words else None,
            )

    return Rule("required_keys", Stage.REQUIRED_KEYS, check)


def peft_type(*, required: bool, words: Words) -> Rule:
    """peft_type must be LORA; ``required``: the engine reads it (SGLang, PEFT), so it is set."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        value = f.config.get("peft_type")
        if value is None and required:
            yield Finding(f"adapter config has no peft_type; {who} needs 'LORA'", _say(words, f))
        elif value is not None and str(value).upper() != "LORA":
            yield Finding(
                f"peft_type is {value!r}; only LORA adapters are supported", _say(words, f)
            )

    return Rule("peft_type", Stage.PEFT_TYPE, check)


def rank_r(*, words: Words) -> Rule:
    """r must be a positive integer (vLLM: ``PEFTHelper.__post_init__``)."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        r = f.config.get("r")
        if r is not None and not is_positive_int(r):
            yield Finding(f"r must be a positive integer, got {r!r}", _say(words, f))

    return Rule("r", Stage.RANK, check)


def rank_pattern(
    *, words: Callable[[str, Any], str] | None, differing_refused: bool = False
) -> Rule:
    """Every rank_pattern value must be a positive integer; ``words(key, rank)`` gives the
    engine's text for the first bad one. ``differing_refused``: the engine sizes and scales
    every module by ``r``, so a pattern that differs from it would be served wrong."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        first = True
        pattern = f.config.get("rank_pattern") or {}
        for mod, pr in pattern.items():
            if not is_positive_int(pr):
                engine = words(mod, pr) if words and first else None
                first = False
                yield Finding(
                    f"rank_pattern[{mod!r}] must be a positive integer, got {pr!r}", engine
                )
        r = f.config.get("r")
        differing = {m: v for m, v in pattern.items() if is_positive_int(v) and v != r}
        if differing_refused and differing:
            yield Finding(
                f"rank_pattern {differing!r} is not supported by {who}: it sizes and scales "
                f"every module by r={r!r}"
            )

    return Rule("rank_pattern", Stage.RANK_PATTERN, check)


def alpha_pattern_ignored() -> Rule:
    """An engine that scales every module by lora_alpha/r ignores alpha_pattern."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        alpha = f.config.get("lora_alpha")
        differing = {m: v for m, v in (f.config.get("alpha_pattern") or {}).items() if v != alpha}
        if differing:
            yield Finding(
                f"alpha_pattern {differing!r} is not supported by {who}: it scales every "
                f"module by lora_alpha={alpha!r}"
            )

    return Rule("alpha_pattern", Stage.FEATURES, check)


def rslora_ignored() -> Rule:
    """An engine that always scales by lora_alpha/r serves an rsLoRA adapter at the wrong scale."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        if f.config.get("use_rslora"):
            yield Finding(
                f"use_rslora=true is not supported by {who}: it scales by lora_alpha/r, "
                "not lora_alpha/sqrt(r)"
            )

    return Rule("use_rslora", Stage.FEATURES, check)


def target_modules_string(*, allowed: Collection[str], words: Words) -> Rule:
    """A string target_modules (a regex in PEFT) is refused unless it is one of ``allowed``."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        targets = f.config.get("target_modules")
        if isinstance(targets, str) and targets and targets not in allowed:
            yield Finding(
                f"target_modules={targets!r} is a regex; {who} needs a list of module names "
                f"or one of {sorted(allowed)}",
                _say(words, f),
            )

    return Rule("target_modules", Stage.FEATURES, check)


def modules_to_save(*, allowed: Collection[str], words: Callable[[list], str] | None) -> Rule:
    """Full copies of modules are not served, except those in ``allowed``."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        bad = [m for m in (f.config.get("modules_to_save") or []) if m not in allowed]
        if bad:
            why = f" (only {sorted(allowed)}, for classification models)" if allowed else ""
            yield Finding(
                f"modules_to_save={bad!r} is not supported by {who}{why}: an engine serves "
                "LoRA weights, not full copies of modules",
                words(bad) if words else None,
            )

    return Rule("modules_to_save", Stage.FEATURES, check)


def feature(
    key: str, refused: Callable[[Any], bool], what: str | Callable[[Any], str], words: Words
) -> Rule:
    """A PEFT feature the engine does not implement: refused when ``refused(config[key])``.
    ``what`` names the feature in lorafleet's message (a function of the value, or a string)."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        value = f.config.get(key)
        if value is not None and refused(value):
            named = what(value) if callable(what) else what
            yield Finding(f"{named} is not supported by {who}", _say(words, f))

    return Rule(key, Stage.FEATURES, check)


def init_lora_weights(*, words: Words) -> Rule:
    """Inits that modify the base weights (PiSSA, OLoRA, CorDA, LoftQ) need that modified base."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        init = f.config.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower() not in PLAIN_INITS:
            yield Finding(
                f"init_lora_weights={init!r} is not supported by {who}: such inits change the "
                "base weights; convert the adapter with PEFT's "
                "path_initial_model_for_weight_conversion",
                _say(words, f),
            )

    return Rule("init_lora_weights", Stage.FEATURES, check)


def max_rank(*, words: Callable[[AdapterFacts, int, int], str] | None) -> Rule:
    """The largest declared rank must fit the engine's max_lora_rank, when that is known."""

    def check(f: AdapterFacts, limits: EngineLimits, who: str) -> Iterable[Finding]:
        rank = declared_rank(f.config)
        if rank is not None and limits.max_rank is not None and rank > limits.max_rank:
            yield Finding(
                f"LoRA rank {rank} is greater than max_lora_rank {limits.max_rank}",
                words(f, rank, limits.max_rank) if words else None,
            )

    return Rule("max_rank", Stage.FEATURES, check)


# --- the weight files ----------------------------------------------------------------------------


def no_weights(*, words: Words) -> Rule:
    """An adapter needs a weights file."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        if not f.weight_files:
            yield Finding(f"no adapter weights ({SAFETENSORS} or {BIN})", _say(words, f))

    return Rule("no_weights", Stage.WEIGHT_FILES, check)


def both_weight_files() -> Rule:
    """With both files present, each engine silently picks one (vLLM: safetensors)."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        if SAFETENSORS in f.weight_files and BIN in f.weight_files:
            yield Finding(
                f"both {SAFETENSORS} and {BIN} are present; engines would silently pick one"
            )

    return Rule("both_weight_files", Stage.WEIGHT_FILES, check)


# --- the tensors ---------------------------------------------------------------------------------


def tensor_names(*, engine_rejects: Callable[[str], str | None] | None = None) -> Rule:
    """Every tensor is a LoRA A/B weight (full modules in modules_to_save are judged by
    ``full_modules``). ``engine_rejects(key)`` gives the engine's text for a name it cannot
    parse (None: it can); the engine stops at the first such name."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        said = False
        for key in f.tensors or {}:
            if _full_module(key, f) is not None:
                continue
            engine = engine_rejects(key) if engine_rejects else None
            if parse_lora_key(key) is None:
                message = f"tensor {key!r} is not a LoRA weight (expected '<module>.lora_A.weight')"
            elif engine is not None:  # e.g. PEFT's in-memory name, lora_A.default.weight
                message = (
                    f"tensor {key!r} is not named as PEFT saves adapters; {who} cannot read it"
                )
            else:
                continue
            yield Finding(message, None if said else engine)
            said = said or engine is not None

    return Rule("tensor_names", Stage.TENSOR_NAMES, check)


def tensor_targets() -> Rule:
    """Each LoRA tensor's module is in target_modules: engines disagree about one that is not
    (vLLM serves it, PEFT ignores it)."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        targets = f.config.get("target_modules")
        if not targets:
            return
        for key, module, _ab in _lora_keys(f):
            if not targets_module(targets, module):
                yield Finding(f"tensor {key!r} targets a module not in target_modules {targets!r}")

    return Rule("tensor_targets", Stage.TENSOR_MODULES, check)


def supported_modules(*, words: Callable[[AdapterFacts, list[str], list[str]], str] | None) -> Rule:
    """Each adapted module must be one the engine can adapt in its model
    (``limits.supported_modules``: leaf names). A classifier head that modules_to_save does not
    list counts as a module too, as vLLM parses it. Skipped when the model is unknown, as it is
    to the bundle and the agent."""

    def check(f: AdapterFacts, limits: EngineLimits, who: str) -> Iterable[Finding]:
        supported = limits.supported_modules
        if supported is None:
            return
        modules = [module for _key, module, _ab in _lora_keys(f)]
        for key in f.tensors or {}:
            parts = key.split(".")
            head = len(parts) >= 2 and parts[-1] in ("weight", "bias") and parts[-2] in HEADS
            if head and _full_module(key, f) is None:
                modules.append(parts[-2])
        unexpected: list[str] = []
        for module in modules:
            if module.rsplit(".", 1)[-1] not in supported and module not in unexpected:
                unexpected.append(module)
        for i, module in enumerate(unexpected):
            received = sorted(strip_prefix(m) for m in unexpected)
            engine = words(f, sorted(supported), received) if words and i == 0 else None
            yield Finding(
                f"module {strip_prefix(module)!r} is not one {who} can adapt in this model",
                engine,
            )

    return Rule("supported_modules", Stage.TENSOR_MODULES, check)


def lora_pairs() -> Rule:
    """Every module has lora_A and lora_B, 2-D, agreeing on a rank that matches the config's."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        if f.tensors is None:
            return
        pairs: dict[str, dict[str, Any]] = {}
        for key, module, ab in _lora_keys(f):
            pairs.setdefault(module, {})[ab] = list(f.tensors[key])
        for module, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                have = next(iter(ab))
                other = "B" if have == "A" else "A"
                yield Finding(f"module {module!r} has lora_{have} but no lora_{other}")
                continue
            a, b = ab["A"], ab["B"]
            want = pattern_value(f.config.get("rank_pattern"), module)
            want = want if want is not None else f.config.get("r")
            if len(a) != 2 or len(b) != 2:
                yield Finding(f"module {module!r}: lora_A/lora_B must be 2-D, got {a} and {b}")
            elif a[0] != b[1]:
                yield Finding(f"module {module!r}: lora_A {a} and lora_B {b} disagree on the rank")
            elif is_positive_int(want) and a[0] != want:
                yield Finding(
                    f"module {module!r}: lora_A {a} / lora_B {b} have rank {a[0]}, but r={want}"
                )
        if not f.tensors:
            yield Finding("the adapter weights contain no tensors")

    return Rule("lora_pairs", Stage.TENSOR_SHAPES, check)


def full_modules(*, words: Callable[[str], str] | None) -> Rule:
    """Full copies of modules (modules_to_save tensors): lorafleet serves generative models,
    and vLLM loads a full module only into a classification head."""

    def check(f: AdapterFacts, _: EngineLimits, who: str) -> Iterable[Finding]:
        first = True
        for key in f.tensors or {}:
            module = _full_module(key, f)
            if module is None:
                continue
            yield Finding(
                f"tensor {key!r} is a full copy of {module!r} (modules_to_save); {who} does not "
                "serve it in a generative model",
                words(module) if words and first else None,
            )
            first = False

    return Rule("full_modules", Stage.FULL_MODULES, check)
