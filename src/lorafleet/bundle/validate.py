"""Validation of an adapter before anything leaves the trainer, and again on the agent.

One message per problem, in the words an operator needs. The rules are the engines' own
(``lorafleet.rules``: one rulebook per engine kind). The trainer checks what every engine kind
refuses; each agent checks its own engine's rulebook, so a bad adapter is stopped before it
produces refusals, or wrong outputs, across a fleet.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.errors import AdapterInvalid
from lorafleet.protocol.manifest import ADAPTER_CONFIG
from lorafleet.rules import AdapterFacts, EngineKind, EngineLimits, declared_rank, rulebook

__all__ = [
    "ValidationReport",
    "check_adapter",
    "config_rank",
    "read_safetensors_shapes",
    "validate_adapter_dir",
]

SAFETENSORS = "adapter_model.safetensors"
BIN = "adapter_model.bin"


@dataclass
class ValidationReport:
    """The outcome of validation. ``preloadable``: an engine can load the directory as it is."""

    problems: list[str] = field(default_factory=list)
    preloadable: bool = False
    rank: int | None = None
    tensors: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self, path: str | None = None) -> None:
        """Raise ``AdapterInvalid`` listing every problem, if there is any."""
        if self.problems:
            raise AdapterInvalid(self.problems, path)


def read_safetensors_shapes(path: str | os.PathLike) -> tuple[dict[str, list[int]], dict | None]:
    """Tensor shapes and metadata from a safetensors header, via the safetensors library."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            shapes[key] = list(f.get_slice(key).get_shape())
    return shapes, metadata


def _read_bin_shapes(path: Path) -> dict[str, list[int]] | None:
    try:
        import torch
    except ImportError:  # the core has no torch: .bin tensors cannot be inspected here
        return None
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    return {k: list(v.shape) for k, v in state.items()}


def config_rank(config: Mapping[str, Any]) -> int | None:
    """The largest LoRA rank a PEFT config declares (``r`` and every ``rank_pattern`` value)."""
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    valid = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    return max(valid) if valid else None


def check_adapter(
    config: Mapping[str, Any] | None,
    shapes: Mapping[str, list[int]] | None,
    *,
    max_rank: int | None = None,
    weight_files: tuple[str, ...] = (SAFETENSORS,),
    engine: EngineKind | None = None,
) -> ValidationReport:
    """Validate a config and tensor shapes (``None``: shapes unknown, e.g. .bin without torch).

    ``engine``: the engine kind whose rulebook applies (``lorafleet.rules``); None: only what
    every engine kind refuses.
    """
    report = ValidationReport()
    if config is None:
        report.problems.append(
            f"missing {ADAPTER_CONFIG} (pass a config dict for native checkpoints)"
        )
        return report
    facts = AdapterFacts(config, shapes, weight_files)
    problems = rulebook(engine).check(facts, EngineLimits(max_rank=max_rank))
    report.problems += [p.message for p in problems]
    report.rank = declared_rank(config)
    if shapes is not None:
        report.tensors = len(shapes)
    return report


def validate_adapter_dir(
    path: str | os.PathLike,
    *,
    config: Mapping[str, Any] | None = None,
    max_rank: int | None = None,
    engine: EngineKind | None = None,
) -> ValidationReport:
    """Validate an adapter directory, optionally with a config dict for a native-only checkpoint.

    ``engine``: the engine kind whose rulebook applies; None: what every engine kind refuses.

    ``report.preloadable`` answers "can an engine load this directory as it is?": it needs a
    valid ``adapter_config.json`` on disk, not just a config dict on the side (seed 004).
    """
    d = Path(path)
    report = ValidationReport()
    if not d.is_dir():
        report.problems.append(f"{d} is not a directory")
        return report
    on_disk: dict | None = None
    cfg_path = d / ADAPTER_CONFIG
    if cfg_path.is_file():
        try:
            on_disk = json.loads(cfg_path.read_text())
            if not isinstance(on_disk, dict):
                report.problems.append(f"{ADAPTER_CONFIG} must hold a JSON object")
                on_disk = None
        except (ValueError, UnicodeDecodeError) as exc:
            report.problems.append(f"{ADAPTER_CONFIG} is not valid JSON: {exc}")
    effective = dict(config) if config is not None else on_disk
    if effective is None and report.problems:
        return report
    weights = tuple(name for name in (SAFETENSORS, BIN) if (d / name).is_file())
    shapes: dict[str, list[int]] | None = None
    try:
        if SAFETENSORS in weights:
            shapes, _ = read_safetensors_shapes(d / SAFETENSORS)
        elif BIN in weights:
            shapes = _read_bin_shapes(d / BIN)
    except Exception as exc:  # a corrupt header is a validation problem, not a crash
        report.problems.append(f"cannot read adapter weights: {exc}")
    inner = check_adapter(effective, shapes, max_rank=max_rank, weight_files=weights, engine=engine)
    report.problems += inner.problems
    report.rank, report.tensors = inner.rank, inner.tensors
    report.preloadable = report.ok and on_disk is not None
    return report
