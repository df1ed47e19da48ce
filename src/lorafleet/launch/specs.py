"""Typed descriptions of the servers lorafleet starts; each builds its own command line.

Two kinds, by how a server gets its address:

- ``SocketServerSpec``: the server serves on a listening socket the launcher binds and passes
  (``lorafleet engine|agent|router --fd N``). Nothing can take the port in between.
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

from lorafleet._settings import argv_for, flags
from lorafleet.agent.limits import UploadLimits
from lorafleet.engine_kinds import EngineKind
from lorafleet.launch.process import lorafleet_argv

__all__ = [
    "AgentSpec",
    "PortServerSpec",
    "ReferenceEngineSpec",
    "RouterSpec",
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


@dataclass(frozen=True, kw_only=True)
class AgentSpec(SocketServerSpec):
    """``lorafleet agent`` in front of one engine."""

    engine_url: str
    data_dir: Path
    engine: EngineKind = "reference"
    token: str | None = None
    """Control token; None lets the agent generate one (printed to its log)."""
    replica_id: str | None = None
    """None: the agent's host:port."""
    max_lora_rank: int | None = None
    shared_fs_allow: tuple[Path, ...] = ()
    limits: UploadLimits = field(default_factory=UploadLimits)
    """Written as flags when they differ from the agent's defaults."""
    extra: tuple[str, ...] = ()
    name: str = "agent"

    def argv(self, fd: int) -> list[str]:
        argv = lorafleet_argv(
            "agent",
            "--engine", self.engine,
            "--engine-url", self.engine_url,
            "--data-dir", str(self.data_dir),
            "--fd", str(fd),
        )  # fmt: skip
        from lorafleet.agent.app import AgentConfig

        if self.replica_id is not None:
            argv += ["--replica-id", self.replica_id]
        argv += flags(
            AgentConfig,
            max_lora_rank=self.max_lora_rank,
            shared_fs_allow=[str(p) for p in self.shared_fs_allow],
        )
        return argv + argv_for(self.limits) + list(self.extra)

    def environ(self) -> dict[str, str]:
        return {"LORAFLEET_CONTROL_TOKEN": self.token or "", **self.env}


@dataclass(frozen=True, kw_only=True)
class RouterSpec(SocketServerSpec):
    """``lorafleet router`` over a set of agents."""

    agents: tuple[str, ...]
    token: str | None = None
    """Control token for /v1/control/*; None: no token."""
    api_key: str | None = None
    """Inference key for the data plane; None: open."""
    agent_token: str | None = None
    """Token to call the agents with; None: the control token."""
    state_dir: Path | None = None
    health_interval: float | None = None
    extra: tuple[str, ...] = ()
    name: str = "router"

    def argv(self, fd: int) -> list[str]:
        argv = lorafleet_argv("router", "--agents", ",".join(self.agents), "--fd", str(fd))
        if self.state_dir is not None:
            argv += ["--state-dir", str(self.state_dir)]
        if self.health_interval is not None:
            from lorafleet.router.app import RouterConfig

            argv += flags(RouterConfig, health_interval_s=self.health_interval)
        if self.agent_token is not None:
            argv += ["--agent-token", self.agent_token]
        return argv + list(self.extra)

    def environ(self) -> dict[str, str]:
        return {
            "LORAFLEET_CONTROL_TOKEN": self.token or "",
            "LORAFLEET_API_KEY": self.api_key or "",
            **self.env,
        }


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
