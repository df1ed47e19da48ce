"""Helpers to make real PEFT adapters and reference outputs on the tiny model.

Used by the tests, the benchmarks and the demo. Needs the ``engine`` extra (torch, peft).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_TARGETS",
    "make_peft_adapter",
    "make_peft_model",
    "merged_greedy",
    "merged_greedy_ids",
]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_peft_model(
    base_dir: str | os.PathLike,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    seed: int = 0,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
    init_lora_weights: bool = False,
    **lora_kwargs: Any,
):
    """A PEFT model on ``base_dir`` with random (``init_lora_weights=False``) LoRA weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        init_lora_weights=init_lora_weights,
        **lora_kwargs,
    )
    return get_peft_model(base, cfg)


def make_peft_adapter(
    base_dir: str | os.PathLike, out_dir: str | os.PathLike, **kwargs: Any
) -> Path:
    """Write a real PEFT adapter directory (``save_pretrained``) and return its path."""
    model = make_peft_model(base_dir, **kwargs)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def merged_greedy(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike | None,
    prompt: str,
    max_tokens: int = 8,
) -> str:
    """Greedy continuation of ``prompt`` by the base model with the adapter merged (float32)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    ids = merged_greedy_ids(base_dir, adapter_dir, prompt, max_tokens)
    return tok.decode(ids, skip_special_tokens=True)


def merged_greedy_ids(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike | None,
    prompt: str,
    max_tokens: int = 8,
) -> list[int]:
    """Token ids of the greedy continuation with the adapter merged in transformers (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id
        )
    return out[0][ids.shape[1] :].tolist()
