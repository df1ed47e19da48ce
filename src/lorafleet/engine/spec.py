"""How ``lorafleet.launch`` starts the reference engine (``lorafleet engine``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet.launch.process import lorafleet_argv
from lorafleet.launch.specs import SocketServerSpec

__all__ = ["ReferenceEngineSpec"]


@dataclass(frozen=True, kw_only=True)
class ReferenceEngineSpec(SocketServerSpec):
    """``lorafleet engine``: the CPU reference engine (needs the ``engine`` extra)."""

    model: Path
    served_model_name: str = "tiny"
    max_loras: int = 8
    max_lora_rank: int = 64
    api_key: str | None = None
    dialect: str = "vllm"
    """vllm (vLLM's API, SGLang's routes beside it) or sglang (as real SGLang 0.5.23)."""
    extra: tuple[str, ...] = ()
    name: str = "engine"
    ready_timeout: float = 120.0  # torch + transformers import on a busy 2-core box

    def argv(self, fd: int) -> list[str]:
        return lorafleet_argv(
            "engine",
            "--model", str(self.model),
            "--served-model-name", self.served_model_name,
            "--fd", str(fd),
            "--max-loras", str(self.max_loras),
            "--max-lora-rank", str(self.max_lora_rank),
            "--dialect", self.dialect,
            *self.extra,
        )  # fmt: skip

    def environ(self) -> dict[str, str]:
        # Always set, so a key in the launcher's own environment never leaks into the engine.
        return {"LORAFLEET_ENGINE_API_KEY": self.api_key or "", **self.env}
