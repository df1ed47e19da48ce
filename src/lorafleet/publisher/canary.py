"""The trainer's side of the canary (``lorafleet.protocol.canary``): what its own model computes.

``compute_canary(model)`` takes the PEFT model the trainer holds (the one a publication is made
from) and returns a ``Canary`` to pass to ``Publisher.publish(canary=...)``: for a few prompts,
the next-token log-probabilities of the tokens that matter (the top ``k`` under the adapter and
the top ``k`` under the base) with the adapter and with it disabled (``disable_adapter``). By
default the prompts are chosen where the adapter moves the next token most (from random token
ids of the model's vocabulary, seeded), so that a replica that applies it wrongly stands out.

``canary_from_dir(base, adapter_dir)`` does the same from a base model and a PEFT directory on
CPU (``lorafleet publish --canary-model``). Needs torch and peft (the trainer's side only).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Any

from lorafleet.protocol.canary import Canary, CanaryPrompt

__all__ = ["canary_from_dir", "compute_canary"]


def _next_logprobs(model: Any, ids: Sequence[int]) -> Any:
    import torch

    x = torch.tensor([list(ids)], device=model.device)
    return torch.log_softmax(model(input_ids=x).logits[0, -1].float(), dim=-1).cpu()


def _prompt(model: Any, ids: Sequence[int], k: int) -> tuple[CanaryPrompt, float]:
    with_adapter = _next_logprobs(model, ids)
    with model.disable_adapter():
        base = _next_logprobs(model, ids)
    tokens = sorted({*with_adapter.topk(k).indices.tolist(), *base.topk(k).indices.tolist()})
    trainer = [float(with_adapter[t]) for t in tokens]
    base_lp = [float(base[t]) for t in tokens]
    shift = sum(abs(a - b) for a, b in zip(trainer, base_lp, strict=True)) / len(tokens)
    prompt = CanaryPrompt(prompt_ids=list(ids), tokens=tokens, trainer=trainer, base=base_lp)
    return prompt, shift


def compute_canary(
    model: Any,
    prompts: Sequence[Sequence[int]] | None = None,
    *,
    k: int = 5,
    n: int = 8,
    length: int = 16,
    seed: int = 0,
) -> Canary:
    """The canary of ``model`` (a ``peft.PeftModel``, its adapter enabled).

    ``prompts``: token-id prompts to use as they are; None: ``n`` prompts of ``length`` random
    token ids (seeded by ``seed``), the ones the adapter moves most of ``4 * n`` candidates.
    ``k``: tokens per prompt from each of the adapter's and the base's top (so 1 to 2k)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if prompts is not None:
                return Canary(prompts=[_prompt(model, p, k)[0] for p in prompts])
            vocab = int(model.get_input_embeddings().weight.shape[0])
            rng = random.Random(seed)
            candidates = [[rng.randrange(vocab) for _ in range(length)] for _ in range(4 * n)]
            scored = [_prompt(model, c, k) for c in candidates]
            scored.sort(key=lambda ps: ps[1], reverse=True)
            return Canary(prompts=[p for p, _ in scored[:n]])
    finally:
        model.train(was_training)


def canary_from_dir(
    base_model: str | os.PathLike, adapter_dir: str | os.PathLike, **kwargs: Any
) -> Canary:
    """``compute_canary`` for the PEFT adapter in ``adapter_dir`` on ``base_model`` (a local
    directory or hub id), in float32 on CPU."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_model), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    return compute_canary(model, **kwargs)
