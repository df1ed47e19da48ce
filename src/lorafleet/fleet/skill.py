"""A tiny, visible skill to train on CPU: answer one prompt with one fixed string.

Used by ``lorafleet demo`` and the integration example. The trainer is a plain PEFT LoRA loop on the
tiny model; the reward is measured elsewhere (through the router), so a rising curve proves that
publication works. Checkpoints are saved *natively* (a torch state dict of the LoRA tensors and the
optimizer, no adapter_config.json), like the Megatron-native shards of seed 004.

Needs the ``engine`` extra (torch, transformers, peft); everything heavy is imported lazily.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TARGET_MODULES", "PROMPT", "TARGET", "SkillTrainer", "TrainSettings", "reward"]

PROMPT = "Q: what does lorafleet do?\nA:"
TARGET = " ships adapters"

# Measured on the 2-core dev box: with all seven projections, r=8 and lr=5e-3 the greedy answer
# reaches the target within 3-6 steps for every seed tried, while the first steps stay visibly
# wrong (a curve, not a jump). The q/k/v/o-only variant needs a higher LR and oscillates.
DEFAULT_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def reward(output: str, target: str = TARGET) -> float:
    """Similarity of ``output`` to ``target`` in [0, 1] (difflib ratio: 1.0 only on equality)."""
    return difflib.SequenceMatcher(None, output, target).ratio()


@dataclass(frozen=True)
class TrainSettings:
    rank: int = 8
    alpha: int = 16
    lr: float = 5e-3
    seed: int = 0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES


class SkillTrainer:
    """A PEFT LoRA model on ``base_dir`` plus its optimizer, trained on (PROMPT, TARGET)."""

    def __init__(
        self,
        base_dir: str | os.PathLike,
        settings: TrainSettings | None = None,
        *,
        prompt: str = PROMPT,
        target: str = TARGET,
    ) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base_dir = Path(base_dir)
        self.settings = s = settings or TrainSettings()
        self.prompt, self.target = prompt, target
        self.tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        torch.manual_seed(s.seed)
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        lora = LoraConfig(
            r=s.rank,
            lora_alpha=s.alpha,
            lora_dropout=0.0,
            target_modules=list(s.target_modules),
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base, lora)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=s.lr
        )
        self.step = 0
        prompt_ids = self.tokenizer(prompt).input_ids
        target_ids = [*self.tokenizer(target).input_ids, self.tokenizer.eos_token_id]
        self._ids = torch.tensor([prompt_ids + target_ids])
        labels = self._ids.clone()
        labels[0, : len(prompt_ids)] = -100  # learn the answer, not the question
        self._labels = labels
        self.max_new_tokens = len(target_ids)

    # -- training ------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on the skill; returns the loss."""
        self.model.train()
        loss = self.model(input_ids=self._ids, labels=self._labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss.item())

    def greedy(self) -> str:
        """The trainer-side greedy answer (for comparison with what the fleet serves)."""
        import torch

        self.model.eval()
        ids = torch.tensor([self.tokenizer(self.prompt).input_ids])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.eos_token_id,
            )
        return self.tokenizer.decode(out[0][ids.shape[1] :], skip_special_tokens=True)

    # -- what gets published ------------------------------------------------------------------
    def lora_state_dict(self) -> dict[str, Any]:
        """The LoRA tensors only (PEFT key names), detached copies."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def config_dict(self) -> dict[str, Any]:
        """The PEFT adapter config as a JSON-safe dict (what a native checkpoint lacks)."""
        from lorafleet.bundle import peft_config_dict

        cfg = peft_config_dict(self.model.peft_config["default"])
        cfg["base_model_name_or_path"] = str(self.base_dir)
        return cfg

    # -- native checkpoints ------------------------------------------------------------------
    def save_native(self, path: str | os.PathLike) -> Path:
        """Save LoRA tensors + optimizer + step with torch.save: no adapter_config.json anywhere."""
        import torch

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(
            {
                "lora": self.lora_state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
            },
            tmp,
        )
        os.replace(tmp, path)  # a crash mid-save never leaves a torn checkpoint
        return path

    @classmethod
    def resume(
        cls,
        base_dir: str | os.PathLike,
        checkpoint: str | os.PathLike,
        settings: TrainSettings | None = None,
        **kwargs: Any,
    ) -> SkillTrainer:
        """A fresh trainer on the base model with the LoRA weights and optimizer restored."""
        import torch
        from peft import set_peft_model_state_dict

        trainer = cls(base_dir, settings, **kwargs)
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        result = set_peft_model_state_dict(trainer.model, state["lora"])
        if result.unexpected_keys:
            raise ValueError(f"checkpoint has unexpected LoRA keys: {result.unexpected_keys[:3]}")
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.step = int(state["step"])
        return trainer
