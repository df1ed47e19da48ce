"""SGLang 0.5.23's rules: what it refuses (in its words), and what it would load and serve wrong.

Sources (sglang 0.5.23 wheel): ``srt/lora/lora_config.py`` (``LoRAConfig``: reads
``target_modules``, ``r``, ``lora_alpha``, ``use_dora`` and nothing else), ``srt/lora/lora.py``
(``LoRAAdapter``: asserts ``peft_type`` is lora, ``scaling = lora_alpha / r``; ``_process_weight``),
``srt/lora/lora_manager.py`` (``validate_new_adapter``), ``srt/lora/mem_pool.py`` (``can_support``,
buffers sliced by ``config.r``; any tensor without "lora_A" in its name is taken as lora_B) and
``srt/lora/utils.py`` (``get_normalized_target_modules``). Load failures answer HTTP 400.

SGLang refuses by itself: DoRA, a rank over ``--max-lora-rank``, a string ``target_modules``
other than "all"/"all-linear", a missing key or a non-LoRA ``peft_type`` (as a bare KeyError or
AssertionError). Everything else below SGLang would load and serve differently from how the
adapter was trained (it never reads rank_pattern, alpha_pattern, use_rslora, modules_to_save,
bias, init_lora_weights, aLoRA, layer_replication, BD-LoRA or QALoRA), so lorafleet refuses it.
Not checked here: the server's ``--lora-target-modules`` must cover the adapter's modules, and
added tokens (``added_tokens.json``, which a bundle never carries) are refused.
"""

from __future__ import annotations

from lorafleet.rules import _checks as c
from lorafleet.rules._core import Rulebook

__all__ = ["SGLANG"]

SGLANG = Rulebook(
    "sglang",
    "SGLang",
    "SGLang 0.5.23",
    (
        c.required_keys(engine_words=False),  # a KeyError: 'r'
        c.peft_type(required=True, words=None),  # a KeyError or a bare AssertionError
        c.rank_r(words=None),
        c.rank_pattern(words=None, differing_refused=True),
        c.alpha_pattern_ignored(),
        c.rslora_ignored(),
        c.target_modules_string(
            allowed=("all", "all-linear"),
            words="Only 'all' or 'all-linear' can be used as the string for target module",
        ),
        c.modules_to_save(allowed=(), words=None),
        c.feature(
            "use_dora",
            bool,
            "DoRA (use_dora=true)",
            lambda f: (
                f"Failed to load {f.name} because LoRA serving currently doesn't support DoRA "
                "adapters"
            ),
        ),
        c.feature("lora_bias", bool, "lora_bias=true", None),
        c.init_lora_weights(words=None),
        c.feature(
            "alora_invocation_tokens", bool, "Activated LoRA (alora_invocation_tokens)", None
        ),
        c.feature("layer_replication", bool, "layer_replication", None),
        c.feature("use_bdlora", bool, "block-diagonal LoRA (use_bdlora)", None),
        c.feature("use_qalora", bool, "QALoRA (use_qalora=true)", None),
        c.max_rank(
            words=lambda f, rank, limit: (
                f"LoRA adapter {f.name} with rank {rank} is incompatible with the current LoRA "
                "memory pool configuration. Please ensure that the LoRA adapter's rank is within "
                "the configured `--max-lora-rank` and that the target modules are included in "
                "`--lora-target-modules`."
            )
        ),
        c.feature("bias", lambda v: v != "none", lambda v: f"bias={v!r}", None),
        c.no_weights(words=None),
        c.both_weight_files(),
        c.tensor_names(),
        c.tensor_targets(),
        c.lora_pairs(),
        c.full_modules(words=None),
    ),
)
