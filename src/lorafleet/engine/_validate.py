"""Check an adapter directory the way vLLM 0.32 does, before PEFT touches it.

vLLM validates in two places: ``PEFTHelper`` (adapter_config.json) and
``LoRAModel.from_local_checkpoint`` (tensor names). The messages below are vLLM's, so a client that
handles vLLM's refusals handles ours. Tensor names come from the safetensors header, read by the
safetensors library.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from lorafleet.bundle.validate import read_safetensors_shapes
from lorafleet.engine._errors import EngineError

__all__ = ["WEIGHT_FILES", "check_adapter_dir", "not_found"]

# vLLM's lookup order for the weights file.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")

_REQUIRED = ("r", "lora_alpha", "target_modules")
_SUPPORTED_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
_LORA_SUFFIXES = (
    ".lora_A.weight",
    ".lora_B.weight",
    ".lora_embedding_A",
    ".lora_embedding_B",
    ".lora_magnitude_vector",
)


def not_found(name: str, path: str) -> EngineError:
    """vLLM's ``LoRAAdapterNotFoundError`` as the API server reports it (404)."""
    return EngineError.not_found(f"Loading lora {name} failed: No adapter found for {path}")


def _feature_problems(cfg: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    unsupported = [
        m for m in (cfg.get("modules_to_save") or []) if m not in ("classifier", "score")
    ]
    if unsupported:
        problems.append(
            "vLLM only supports modules_to_save being either None "
            'or ["classifier", "score"] for classification models. '
            f"Unsupported modules_to_save: {unsupported}"
        )
    if cfg.get("use_dora"):
        problems.append("vLLM does not yet support DoRA.")
    if cfg.get("lora_bias"):
        problems.append("vLLM does not support LoRA bias (lora_bias).")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _SUPPORTED_INITS:
        problems.append(f"vLLM does not support init_lora_weights={init!r}.")
    if cfg.get("alora_invocation_tokens"):
        problems.append("vLLM does not support Activated LoRA (aLoRA).")
    if cfg.get("layer_replication"):
        problems.append("vLLM does not support layer_replication.")
    if cfg.get("use_qalora"):
        problems.append("vLLM does not support QALoRA.")
    return problems


def _tensor_names(path: Path) -> list[str]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        try:
            shapes, _ = read_safetensors_shapes(st)
        except Exception as exc:  # a corrupt header: vLLM fails the load with a 500
            raise EngineError.internal(f"{st} is not a readable safetensors file: {exc}") from exc
        return list(shapes)
    for other in WEIGHT_FILES[1:]:
        if (path / other).is_file():
            import torch  # .bin/.pt only; the engine already has torch loaded

            return list(torch.load(path / other, map_location="cpu", weights_only=True))
    raise EngineError.internal(f"{path} doesn't contain tensors")


def _module_of(key: str) -> str:
    for suffix in _LORA_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key.rsplit(".", 1)[0]


def check_adapter_dir(
    name: str, lora_path: str, *, max_lora_rank: int, expected_modules: Collection[str]
) -> dict[str, Any]:
    """Return the parsed adapter_config.json, or raise the ``EngineError`` vLLM would answer.

    Raises: 404 when the directory or its adapter_config.json is missing; 500
    (``InternalServerError``, as vLLM 0.32) for an adapter vLLM would refuse to load.
    """
    path = Path(lora_path)
    cfg_file = path / "adapter_config.json"
    if not os.path.isabs(lora_path) and not path.exists():
        raise not_found(name, lora_path)
    if not path.is_dir() or not cfg_file.is_file():
        raise not_found(name, lora_path)
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError.internal(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise EngineError.internal(f"{cfg_file} is not a JSON object")
    missing = set(_REQUIRED) - set(cfg)
    if missing:
        raise EngineError.internal(f"Missing required configuration fields: {missing}")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise EngineError.internal(f"Only LoRA adapters are supported, got peft_type={peft_type}.")
    ranks = [cfg["r"], *(cfg.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise EngineError.internal(f"LoRA rank `r` must be a positive integer, got {cfg['r']}.")
    problems = _feature_problems(cfg)
    if max(ranks) > max_lora_rank:
        problems.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}.")
    if cfg.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    if problems:
        raise EngineError.internal(" ".join(problems))
    unexpected = []
    for key in _tensor_names(path):
        module = _module_of(key)
        if module.rsplit(".", 1)[-1] not in expected_modules:
            unexpected.append(module)
    if unexpected:
        raise EngineError.internal(
            f"While loading {lora_path}, expected target modules in "
            f"{sorted(expected_modules)} but received {sorted(set(unexpected))}. "
            "Please verify that the loaded LoRA module is correct"
        )
    return cfg
