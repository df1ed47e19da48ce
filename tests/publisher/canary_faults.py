"""What can reach an engine other than what the trainer computed its canary with, as an export
bug would make it (shared by the reference-engine and the real-engine canary tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def _config(d: Path, **changes) -> None:
    cfg = json.loads((d / CONFIG).read_text())
    cfg.update({k: v(cfg) if callable(v) else v for k, v in changes.items()})
    (d / CONFIG).write_text(json.dumps(cfg))


def alpha_times_4(d: Path) -> None:
    _config(d, lora_alpha=lambda c: c["lora_alpha"] * 4)


def mlp_dropped(d: Path) -> None:
    tensors = load_file(str(d / WEIGHTS))
    kept = {k: v for k, v in tensors.items() if not any(m in k for m in ("gate", "up_", "down"))}
    assert len(kept) < len(tensors), "the adapter has no MLP tensors to drop"
    save_file(kept, str(d / WEIGHTS))
    _config(d, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def rank_halved(d: Path) -> None:
    # The first half of the rank, its scaling kept (alpha / r): only the rest is lost.
    r = json.loads((d / CONFIG).read_text())["r"]
    tensors = load_file(str(d / WEIGHTS))
    half = r // 2
    cut = {
        k: (v[:half].contiguous() if "lora_A" in k else v[:, :half].contiguous())
        for k, v in tensors.items()
    }
    save_file(cut, str(d / WEIGHTS))
    _config(d, r=half, lora_alpha=lambda c: c["lora_alpha"] // 2)


def base_served(d: Path) -> None:
    tensors = load_file(str(d / WEIGHTS))
    save_file({k: (v * 0 if "lora_B" in k else v) for k, v in tensors.items()}, str(d / WEIGHTS))


FAULTS: dict[str, Callable[[Path], None]] = {
    "lora_alpha": alpha_times_4,
    "mlp_dropped": mlp_dropped,
    "rank_truncated": rank_halved,
    "base_served": base_served,
}
