"""The reference engine's rules: vLLM 0.32's, in vLLM's words, plus what PEFT itself needs.

The reference engine stands in for vLLM, so it refuses exactly what vLLM refuses, even where
PEFT could load more (DoRA, bias, modules_to_save, ...): an adapter that passes on the reference
engine must pass on vLLM. Its one extra rule is PEFT's: ``PeftModel.from_pretrained`` needs
``peft_type``, and only LORA builds the layers the engine manages, so a missing or other
``peft_type`` is refused up front (HTTP 500, like vLLM's load failures) instead of by PEFT.
"""

from __future__ import annotations

from lorafleet.rules import _checks as c
from lorafleet.rules._core import Rulebook
from lorafleet.rules.vllm import vllm_rules

__all__ = ["REFERENCE"]

REFERENCE = Rulebook(
    "reference",
    "the reference engine",
    "vLLM 0.32's rules + PEFT 0.21's peft_type",
    vllm_rules(
        peft_type=c.peft_type(
            required=True,
            words=lambda f: (
                f"Only LoRA adapters are supported, got peft_type={f.config.get('peft_type')}."
            ),
        )
    ),
)
