"""How large a LoRA adapter's change to the base weights can be, read from its tensors.

The agent's application probe needs it: an adapter whose delta is exactly zero (a freshly
initialised PEFT adapter, B = 0) cannot change any output, and one whose delta is tiny may not
change it visibly; neither is evidence that an engine ignored the adapter.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["lora_delta_bound"]

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.[^.]+)?\.weight$")


def _max_abs(f: Any, key: str, path: str) -> float | None:
    try:
        import numpy as np

        return float(np.abs(f.get_tensor(key)).max(initial=0.0))
    except (TypeError, ValueError):  # bfloat16 has no numpy type
        try:
            import torch  # noqa: F401 - only to read bfloat16 where torch is installed
        except ImportError:
            return None
        from safetensors import safe_open

        with safe_open(path, framework="pt") as g:
            t = g.get_tensor(key)
            return float(t.abs().max().item()) if t.numel() else 0.0


def lora_delta_bound(path: str | os.PathLike, config: Mapping[str, Any]) -> float | None:
    """An upper bound on the entries of ``scale * B @ A`` over every module of the adapter.

    0.0 when every module's A or B is all zeros (the adapter changes nothing); None when the
    weights cannot be read here (``.bin`` files, or bfloat16 without torch).
    """
    from safetensors import safe_open

    r = config.get("r") or 1
    ranks = [r, *(config.get("rank_pattern") or {}).values()]
    alphas = [config.get("lora_alpha") or r, *(config.get("alpha_pattern") or {}).values()]
    rank, alpha = max(ranks), max(alphas)
    scale = alpha / (min(ranks) ** 0.5 if config.get("use_rslora") else min(ranks))
    maxima: dict[str, dict[str, float]] = {}
    with safe_open(str(path), framework="numpy") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            m = _KEY.match(key)
            if m is None:
                continue
            value = _max_abs(f, key, str(path))
            if value is None:
                return None
            maxima.setdefault(m["module"], {})[m["ab"]] = value
    # |(B @ A)[i, j]| <= rank * max|B| * max|A| for each module.
    return max(
        (scale * rank * ab.get("A", 0.0) * ab.get("B", 0.0) for ab in maxima.values()),
        default=0.0,
    )
