"""Check an adapter directory the way vLLM 0.32 does, before PEFT touches it.

The rules are the reference engine's rulebook (``lorafleet.rules.reference``: vLLM's rules in
vLLM's words, plus PEFT's need for ``peft_type``). This module does what vLLM does around them:
404 for a missing directory or config, then the config's rules, then the weights, stopping at the
first stage that refuses, with one 500 whose message is vLLM's. Rules that only lorafleet
enforces (an engine would load the adapter) do not refuse here: the engine accepts what vLLM
accepts. Tensor names and shapes come from the safetensors header.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from lorafleet.bundle.validate import read_safetensors_shapes
from lorafleet.engine._errors import EngineError
from lorafleet.rules import REFERENCE, AdapterFacts, EngineLimits, Problem, Rulebook

__all__ = ["WEIGHT_FILES", "check_adapter_dir", "not_found"]

# vLLM's lookup order for the weights file.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


def not_found(name: str, path: str) -> EngineError:
    """vLLM's ``LoRAAdapterNotFoundError`` as the API server reports it (404)."""
    return EngineError.not_found(f"Loading lora {name} failed: No adapter found for {path}")


def _refuse(problems: list[Problem]) -> None:
    """Raise the engine's refusal: the first refusing stage, its messages joined as vLLM does."""
    refusals = [p for p in problems if p.engine_message is not None]
    if refusals:
        stage = refusals[0].stage
        raise EngineError.internal(
            " ".join(p.engine_message for p in refusals if p.stage == stage)  # type: ignore[misc]
        )


def _tensor_shapes(path: Path, weight_files: tuple[str, ...]) -> dict[str, list[int]]:
    """Shapes from the first weights file in vLLM's order (safetensors: its header only)."""
    first = weight_files[0]
    if first == WEIGHT_FILES[0]:
        try:
            shapes, _ = read_safetensors_shapes(path / first)
        except Exception as exc:  # a corrupt header: vLLM fails the load with a 500
            raise EngineError.internal(
                f"{path / first} is not a readable safetensors file: {exc}"
            ) from exc
        return shapes
    import torch  # .bin/.pt only; the engine already has torch loaded

    state = torch.load(path / first, map_location="cpu", weights_only=True)
    return {k: list(v.shape) for k, v in state.items()}


def check_adapter_dir(
    name: str,
    lora_path: str,
    *,
    max_lora_rank: int,
    expected_modules: Collection[str],
    rules: Rulebook = REFERENCE,
) -> dict[str, Any]:
    """Return the parsed adapter_config.json, or raise the ``EngineError`` vLLM would answer.

    Raises: 404 when the directory or its adapter_config.json is missing; 500
    (``InternalServerError``, as vLLM 0.32) for an adapter vLLM would refuse to load.
    """
    path = Path(lora_path)
    cfg_file = path / "adapter_config.json"
    try:
        if not os.path.isabs(lora_path) and not path.exists():
            raise not_found(name, lora_path)
        if not path.is_dir() or not cfg_file.is_file():
            raise not_found(name, lora_path)
    except (OSError, ValueError):  # a name too long, a NUL byte, text no filesystem takes
        raise not_found(name, lora_path) from None
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError.internal(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise EngineError.internal(f"{cfg_file} is not a JSON object")
    weight_files = tuple(f for f in WEIGHT_FILES if (path / f).is_file())
    limits = EngineLimits(max_rank=max_lora_rank, supported_modules=frozenset(expected_modules))
    facts = AdapterFacts(cfg, None, weight_files, path=lora_path, name=name)
    # Like vLLM: the config (and whether there are weights at all) first, then the tensors.
    _refuse(rules.check(facts, limits))
    _refuse(rules.check(replace(facts, tensors=_tensor_shapes(path, weight_files)), limits))
    return cfg
