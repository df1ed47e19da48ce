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
    echo_top_logprobs=False,
)
