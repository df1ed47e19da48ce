"""The embedded CPU reference engine (``lorafleet engine``): it imitates vLLM's API."""

from __future__ import annotations

from lorafleet.engine_kinds import EngineKindInfo

KIND = EngineKindInfo(
    name="reference",
    title="lorafleet's reference engine",
    backend="lorafleet.agent.backends.reference:ReferenceBackend",
    rules="lorafleet.rules.reference:REFERENCE",
    launch_spec="lorafleet.engine.spec:ReferenceEngineSpec",
    embedded=True,
    # float32 torch, the trainer's own arithmetic: 2e-6 at most measured (bench/RESULTS.md).
    canary_tolerance=0.01,
    # What its /v1/completions honours beyond OpenAI's own fields (n, seed and
    # prompt_logprobs are the base protocol's).
    completion_fields=frozenset({"top_k"}),
)
