"""Validate an assembled adapter directory before it is loaded.

Uses the bundle validator (``lorafleet.bundle.validate_adapter_dir``) when it is available, and a
small built-in check with the same result shape otherwise, so the agent never depends on the
order in which components land. Either way: no torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report", "config_rank", "validate"]


@dataclass
class Report:
    ok: bool
    problems: list[str] = field(default_factory=list)


def config_rank(config: dict[str, Any]) -> int | None:
    """The largest LoRA rank a PEFT config declares (``r`` and every ``rank_pattern`` value)."""
    ranks = []
    if isinstance(config.get("r"), int):
        ranks.append(config["r"])
    pattern = config.get("rank_pattern")
    if isinstance(pattern, dict):
        ranks.extend(v for v in pattern.values() if isinstance(v, int))
    return max(ranks) if ranks else None


def validate(path: Path, config: dict[str, Any] | None, max_rank: int | None) -> Report:
    try:
        from lorafleet.bundle import validate_adapter_dir  # type: ignore[attr-defined]
    except ImportError:
        return _builtin(path, config, max_rank)
    rep = validate_adapter_dir(path, config=config, max_rank=max_rank)
    return Report(ok=bool(rep.ok), problems=list(rep.problems))


def _builtin(path: Path, config: dict[str, Any] | None, max_rank: int | None) -> Report:
    problems: list[str] = []
    cfg_file = path / "adapter_config.json"
    if config is None:
        try:
            config = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as exc:
            return Report(False, [f"adapter_config.json unreadable: {exc}"])
    if not isinstance(config, dict):
        return Report(False, ["adapter_config.json is not a JSON object"])
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        problems.append(f"adapter_config.json lacks required keys: {', '.join(missing)}")
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported by the engines")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config.get('bias')!r} is not supported (must be 'none')")
    rank = config_rank(config)
    if rank is not None and rank <= 0:
        problems.append(f"LoRA rank {rank} must be positive")
    if rank is not None and max_rank is not None and rank > max_rank:
        problems.append(f"LoRA rank {rank} is greater than the engine's max_lora_rank {max_rank}")
    st = path / "adapter_model.safetensors"
    if st.exists():
        problems.extend(_safetensors_problems(st))
    elif not (path / "adapter_model.bin").exists():
        problems.append("no weight file (adapter_model.safetensors or adapter_model.bin)")
    return Report(not problems, problems)


def _safetensors_problems(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                return [f"{path.name}: header length {n} is implausible"]
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as exc:
        return [f"{path.name} is not a safetensors file: {exc}"]
    names = [k for k in header if k != "__metadata__"]
    if not names:
        return [f"{path.name} holds no tensors"]
    if not any("lora_A" in k or "lora_B" in k for k in names):
        return [f"{path.name} holds no lora_A/lora_B tensors"]
    return []
