"""Typed descriptions of the servers lorafleet starts; each builds its own command line.

Two kinds, by how a server gets its address:

- ``SocketServerSpec``: the server serves on a listening socket the launcher binds and passes
  (``lorafleet engine|agent|router --fd N``). Nothing can take the port in between. lorafleet's
  own servers' specs live beside them (``agent/spec.py``, ``router/spec.py``,
  ``engine/spec.py``); the engines lorafleet does not own (vLLM, SGLang) are here.
- ``PortServerSpec``: the server binds a port itself (real vLLM, real SGLang). The launcher
  reserves a free port, and starts the server again on a new one if it dies with "address
  already in use".

Secrets (control tokens, API keys) travel in the environment, not in argv, where ``ps`` shows them.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PortServerSpec",
    "SGLangSpec",
    "ServerSpec",
    "SocketServerSpec",
    "VLLMSpec",
]


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """What every server has: where it listens, its name (log file, messages), readiness."""

    host: str = "127.0.0.1"
    port: int = 0
    """0: any free port."""
    name: str = "server"
    ready_path: str = "/health"
    ready_status: int = 200
    ready_timeout: float = 60.0
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for the process."""
    term_group: bool = True
    """Stop with SIGTERM to the whole process group; False: to the launch pid only (a server
    that stops its own children). Whatever is left is killed with the group either way."""

    def environ(self) -> dict[str, str]:
        """The environment the process gets on top of this one's."""
        return dict(self.env)


@dataclass(frozen=True, kw_only=True)
class SocketServerSpec(ServerSpec, ABC):
    """A server that serves on an inherited listening socket."""

    @abstractmethod
    def argv(self, fd: int) -> list[str]:
        """The command line that serves on descriptor ``fd``."""


@dataclass(frozen=True, kw_only=True)
class PortServerSpec(ServerSpec, ABC):
    """A server that binds its port itself."""

    port_retries: int = 3
    """New ports to try when a chosen one was taken before the server bound it."""

    @abstractmethod
    def argv(self, port: int) -> list[str]:
        """The command line that listens on ``host:port``."""


@dataclass(frozen=True, kw_only=True)
class VLLMSpec(PortServerSpec):
    """A real vLLM OpenAI server with runtime LoRA (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""

    model: Path
    python: Path = Path(sys.executable)
    """The interpreter of the environment vLLM is installed in."""
    served_model_name: str = "tiny"
    max_lora_rank: int = 16
    max_loras: int = 4
    max_model_len: int = 256
    dtype: str = "float32"
    extra: tuple[str, ...] = ()
    name: str = "vllm"
    ready_timeout: float = 300.0

    def argv(self, port: int) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_model_name,
            "--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
            "--max-loras", str(self.max_loras), "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype, "--host", self.host, "--port", str(port),
            # vLLM's native token-in token-out /inference/v1/generate (SkyRL's generation
            # route, which the router forwards to vLLM replicas) is off without it (a 403).
            "--enable-scale-out", *self.extra,
        ]  # fmt: skip

    def environ(self) -> dict[str, str]:
        # Without the flag vLLM has no load/unload routes; 1 GiB of KV cache is plenty on CPU.
        return {
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            **self.env,
        }


@dataclass(frozen=True, kw_only=True)
class SGLangSpec(PortServerSpec):
    """A real SGLang 0.5.23 server on CPU with runtime LoRA (docs/engines/sglang.md, "Launch").

    Ready on ``GET /ready`` (``/health`` runs a generation and takes at least a second).
    Stopped with SIGTERM to the launch pid only: it drains and stops ``sglang::scheduler`` and
    ``sglang::detokenizer`` itself, while a SIGTERM that reaches the scheduler directly reads to
    SGLang as a crash (SIGQUIT, 5 s of crash diagnostics). The process group they share is then
    swept with SIGKILL, which also ends the lingering ``resource_tracker``.
    """

    model: Path
    python: Path = Path(sys.executable)
    """The interpreter of the environment SGLang is installed in (scripts/setup-sglang.sh)."""
    served_model_name: str = "tiny"
    max_lora_rank: int = 16
    lora_target_modules: tuple[str, ...] = ("all",)
    max_loaded_loras: int | None = None
    """None: no cap (SGLang's default)."""
    max_loras_per_batch: int | None = None
    """None: SGLang's default, 8."""
    max_total_tokens: int = 4096
    """Without it the KV pool is sized from free RAM (about 14 GB on a CPU box)."""
    dtype: str = "float32"
    api_key: str | None = None
    extra: tuple[str, ...] = ()
    name: str = "sglang"
    ready_path: str = "/ready"
    term_group: bool = False
    ready_timeout: float = 600.0  # ~50 CPU-seconds of imports: 30 s quiet, minutes on a busy box

    def argv(self, port: int) -> list[str]:
        argv = [
            str(self.python), "-m", "sglang.launch_server",
            "--model-path", str(self.model), "--served-model-name", self.served_model_name,
            "--device", "cpu", "--dtype", self.dtype,
            "--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
            "--lora-target-modules", *self.lora_target_modules,
            "--lora-backend", "torch_native",
            "--max-total-tokens", str(self.max_total_tokens),
            "--disable-overlap-schedule", "--skip-server-warmup",
            # Idle, the scheduler's loop spins at ~85 % of a core; with this it waits on its
            # sockets (1 s poll, woken by any request) instead.
            "--sleep-on-idle",
            "--host", self.host, "--port", str(port),
        ]  # fmt: skip
        if self.max_loaded_loras is not None:
            argv += ["--max-loaded-loras", str(self.max_loaded_loras)]
        if self.max_loras_per_batch is not None:
            argv += ["--max-loras-per-batch", str(self.max_loras_per_batch)]
        if self.api_key is not None:
            argv += ["--api-key", self.api_key]
        return argv + list(self.extra)

    def environ(self) -> dict[str, str]:
        # The CPU engine is switched on by the environment, not by --device cpu; three Python
        # processes share the box's cores; no hub (a missing local path is tried as a repo id).
        return {
            "SGLANG_USE_CPU_ENGINE": "1",
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            **self.env,
        }
