"""What each engine kind accepts in a LoRA adapter: one rulebook per engine kind (torch-free).

    from lorafleet.rules import AdapterFacts, EngineLimits, rulebook

    facts = AdapterFacts(config, tensors={"...q_proj.lora_A.weight": [8, 64], ...})
    for problem in rulebook("sglang").check(facts, EngineLimits(max_rank=16)):
        print(problem.rule, problem.message, problem.engine_message)

- ``vllm``: vLLM 0.32 (``rules.vllm``); ``sglang``: SGLang 0.5.23 (``rules.sglang``);
  ``reference``: the reference engine, vLLM's rules plus PEFT's need for ``peft_type``
  (``rules.reference``).
- ``rulebook(None)`` is the shared book: a topic is refused only when every engine kind refuses
  it. The trainer validates with it (nothing any engine would accept is refused early); each
  agent validates with its engine's book, so a refusal names the replica.
- Each ``Problem`` has lorafleet's wording (``message``) and, where the engine refuses the
  adapter itself, the engine's own (``engine_message``), which the reference engine answers.
- Besides the engines' rules, every book holds lorafleet's own: tensors are LoRA A/B pairs whose
  shapes agree with ``r``/``rank_pattern`` and whose modules are in ``target_modules``.

Where the engines differ (vLLM 0.32 and the reference engine / SGLang 0.5.23; details and
sources in each module's docstring):

- ``init_lora_weights``: the plain inits (gaussian, eva, orthogonal, mica, lora_ga) pass
  everywhere; PiSSA, OLoRA, CorDA and LoftQ are refused everywhere (vLLM itself refuses them;
  SGLang ignores the key and would serve them over the unmodified base).
- ``modules_to_save``: None or a classifier/score head / none at all (SGLang drops full modules).
- ``peft_type``: never read (the reference engine needs LORA) / required, LORA.
- a string ``target_modules``: any regex or "all-linear" / only "all" or "all-linear".
- ``use_rslora``, ``rank_pattern``, ``alpha_pattern``: honoured / refused (SGLang scales every
  module by lora_alpha/r and sizes it by r).
"""

from __future__ import annotations

from lorafleet.engine_kinds import ENGINE_KINDS, EngineKind, engine_kind
from lorafleet.rules._core import (
    AdapterFacts,
    EngineLimits,
    Problem,
    Rule,
    Rulebook,
    Stage,
    shared_rulebook,
)
from lorafleet.rules._peft import declared_rank
from lorafleet.rules.reference import REFERENCE
from lorafleet.rules.sglang import SGLANG
from lorafleet.rules.vllm import VLLM

__all__ = [
    "ENGINE_KINDS",
    "REFERENCE",
    "SGLANG",
    "SHARED",
    "VLLM",
    "AdapterFacts",
    "EngineKind",
    "EngineLimits",
    "Problem",
    "Rule",
    "Rulebook",
    "Stage",
    "declared_rank",
    "rulebook",
]

SHARED = shared_rulebook([engine_kind(k).rulebook() for k in ENGINE_KINDS])


def rulebook(kind: EngineKind | str | None = None) -> Rulebook:
    """The rulebook of an engine kind; None: the rules every engine kind shares.

    Raises ``ValueError`` for an unknown kind.
    """
    if kind is None:
        return SHARED
    return engine_kind(kind).rulebook()
