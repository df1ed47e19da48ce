"""Validation of an adapter before anything leaves the trainer, and again on the agent.

One message per problem, in the words an operator needs. The checks mirror what vLLM's
``PEFTHelper`` and ``LoRAModel.from_local_checkpoint`` refuse (research/vllm-and-fleet-managers.md
§1.5), so a bad adapter is stopped here instead of producing 500s across a fleet.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.bundle.manifest import ADAPTER_CONFIG
from lorafleet.errors import AdapterInvalid

__all__ = [
    "ValidationReport",
    "check_adapter",
    "config_rank",
    "read_safetensors_shapes",
    "validate_adapter_dir",
]

SAFETENSORS = "adapter_model.safetensors"
BIN = "adapter_model.bin"

# base_model.model.<module path>.lora_A[.<adapter>].weight
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_UNSUPPORTED_INIT = ("pissa", "olora", "loftq", "corda", "eva")


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


def _module_matches(module: str, targets: Any) -> bool:
    if isinstance(targets, str):
        if targets == "all-linear":
            return True
        return re.fullmatch(targets, module) is not None
    leaf = module.rsplit(".", 1)[-1]
    return any(module == t or leaf == t or module.endswith("." + t) for t in targets)


def _check_config(config: Mapping[str, Any], max_rank: int | None) -> tuple[list[str], int | None]:
    problems: list[str] = []
    peft_type = config.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        problems.append(f"peft_type is {peft_type!r}; only LORA adapters are supported")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if config.get(k) in (None, "", [])]
    if missing:
        problems.append(f"adapter config is missing required keys: {', '.join(missing)}")
    r = config.get("r")
    ranks: list[int] = []
    if r is not None:
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            problems.append(f"r must be a positive integer, got {r!r}")
        else:
            ranks.append(r)
    for mod, pr in (config.get("rank_pattern") or {}).items():
        if not isinstance(pr, int) or pr <= 0:
            problems.append(f"rank_pattern[{mod!r}] must be a positive integer, got {pr!r}")
        else:
            ranks.append(pr)
    if config.get("use_dora"):
        problems.append("DoRA (use_dora=true) is not supported by vLLM")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        problems.append(f"bias={bias!r} is not supported (vLLM needs bias='none')")
    if config.get("lora_bias"):
        problems.append("lora_bias=true is not supported by vLLM")
    mts = config.get("modules_to_save")
    if mts:
        problems.append(f"modules_to_save={mts!r} is not supported by vLLM")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_UNSUPPORTED_INIT):
        problems.append(f"init_lora_weights={init!r} changes the base weights; vLLM refuses it")
    if config.get("layer_replication"):
        problems.append("layer_replication is not supported by vLLM")
    rank = max(ranks) if ranks else None
    if rank is not None and max_rank is not None and rank > max_rank:
        problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}")
    return problems, rank


def _expected_rank(module: str, config: Mapping[str, Any]) -> int | None:
    for pattern, pr in (config.get("rank_pattern") or {}).items():
        if module == pattern or module.endswith("." + pattern) or re.search(pattern, module):
            return pr
    r = config.get("r")
    return r if isinstance(r, int) else None


def _check_tensors(shapes: Mapping[str, list[int]], config: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    targets = config.get("target_modules")
    pairs: dict[str, dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        m = _LORA_KEY.match(key)
        if not m:
            problems.append(
                f"tensor {key!r} is not a LoRA weight (expected '<module>.lora_A.weight')"
            )
            continue
        module = m["module"]
        pairs.setdefault(module, {})[m["ab"]] = shape
        if targets and not _module_matches(module, targets):
            problems.append(f"tensor {key!r} targets a module not in target_modules {targets!r}")
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            have = next(iter(ab))
            problems.append(
                f"module {module!r} has lora_{have} but no lora_{'B' if have == 'A' else 'A'}"
            )
            continue
        a, b = ab["A"], ab["B"]
        want = _expected_rank(module, config)
        if len(a) != 2 or len(b) != 2:
            problems.append(f"module {module!r}: lora_A/lora_B must be 2-D, got {a} and {b}")
        elif a[0] != b[1]:
            problems.append(f"module {module!r}: lora_A {a} and lora_B {b} disagree on the rank")
        elif want is not None and a[0] != want:
            problems.append(
                f"module {module!r}: lora_A {a} / lora_B {b} have rank {a[0]}, but r={want}"
            )
    if not shapes:
        problems.append("the adapter weights contain no tensors")
    return problems


def check_adapter(
    config: Mapping[str, Any] | None,
    shapes: Mapping[str, list[int]] | None,
    *,
    max_rank: int | None = None,
    weight_files: tuple[str, ...] = (SAFETENSORS,),
) -> ValidationReport:
    """Validate a config and tensor shapes (``None``: shapes unknown, e.g. .bin without torch)."""
    report = ValidationReport()
    if config is None:
        report.problems.append(
            f"missing {ADAPTER_CONFIG} (pass a config dict for native checkpoints)"
        )
        return report
    problems, rank = _check_config(config, max_rank)
    report.problems += problems
    report.rank = rank
    if SAFETENSORS in weight_files and BIN in weight_files:
        report.problems.append(
            f"both {SAFETENSORS} and {BIN} are present; engines would silently pick one"
        )
    elif not weight_files:
        report.problems.append(f"no adapter weights ({SAFETENSORS} or {BIN})")
    if shapes is not None:
        report.tensors = len(shapes)
        report.problems += _check_tensors(shapes, config)
    return report


def validate_adapter_dir(
    path: str | os.PathLike, *, config: Mapping[str, Any] | None = None, max_rank: int | None = None
) -> ValidationReport:
    """Validate an adapter directory, optionally with a config dict for a native-only checkpoint.

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
    inner = check_adapter(effective, shapes, max_rank=max_rank, weight_files=weights)
    report.problems += inner.problems
    report.rank, report.tensors = inner.rank, inner.tensors
    report.preloadable = report.ok and on_disk is not None
    return report
