"""How PEFT names and patterns LoRA tensors (peft 0.21 ``tuners/lora``, ``utils/other.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "PREFIX",
    "declared_rank",
    "is_positive_int",
    "parse_lora_key",
    "pattern_value",
    "strip_prefix",
    "targets_module",
]

PREFIX = "base_model.model."

# <module>.lora_A.weight (also with PEFT's in-memory adapter segment: lora_A.default.weight)
_LINEAR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# <module>.lora_embedding_A: embedding LoRA is a bare parameter, (r, vocab) and (dim, r)
_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<ab>[AB])(?:\.[^.]+)?$")


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def parse_lora_key(key: str) -> tuple[str, str] | None:
    """``(module, "A"|"B")`` for a LoRA tensor name, None for anything else."""
    m = _LINEAR.match(key) or _EMBEDDING.match(key)
    return (m["module"], m["ab"]) if m else None


def strip_prefix(module: str) -> str:
    """The module's name in the base model (PEFT's saved names start with ``base_model.model.``)."""
    return module.removeprefix(PREFIX)


def pattern_value(pattern: Mapping[str, Any] | None, module: str) -> Any:
    """PEFT's ``get_pattern_key``: the first key that is a dot-bounded suffix of ``module``."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", strip_prefix(module)):
            return value
    return None


def targets_module(targets: Any, module: str) -> bool:
    """Whether PEFT's ``target_modules`` covers ``module`` (a list of names, a regex, or
    ``"all-linear"``, which PEFT expands to every linear layer but the output layer)."""
    name = strip_prefix(module)
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, name) is not None
    leaf = name.rsplit(".", 1)[-1]
    return any(name == t or leaf == t or name.endswith("." + t) for t in targets)


def declared_rank(config: Mapping[str, Any]) -> int | None:
    """The largest valid rank the config declares (``r`` and every ``rank_pattern`` value)."""
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    valid = [r for r in ranks if is_positive_int(r)]
    return max(valid) if valid else None
