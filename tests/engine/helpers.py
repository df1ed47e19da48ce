"""Ground truth shared by the engine tests: HF transformers greedy with the adapter merged."""

from __future__ import annotations

import functools

PROMPT = "The quick brown fox"


@functools.cache
def expected(base: str, adapter: str | None, prompt: str = PROMPT, n: int = 8) -> str:
    """HF transformers greedy with the adapter merged: the ground truth for every engine.

    vLLM never emits the bytes of a UTF-8 character cut off by the token limit, where HF's
    ``decode`` shows U+FFFD; the tokens are the same, so compare without that tail.
    """
    from lorafleet.testing import merged_greedy

    return merged_greedy(base, adapter, prompt, max_tokens=n).rstrip("\ufffd")


@functools.cache
def expected_ids(base: str, adapter: str | None, prompt: str = PROMPT, n: int = 8) -> list[int]:
    """The token ids of HF greedy with the adapter merged (EOS included, as engines count it)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.eval().generate(
            ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id
        )
    return out[0][ids.shape[1] :].tolist()
