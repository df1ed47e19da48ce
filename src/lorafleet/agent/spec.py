"""How ``lorafleet.launch`` starts an agent (``lorafleet agent``): its settings become flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lorafleet._settings import argv_for
from lorafleet.agent.config import AgentSettings
from lorafleet.agent.limits import UploadLimits
from lorafleet.launch.process import lorafleet_argv
from lorafleet.launch.specs import SocketServerSpec
from lorafleet.protocol.agent import EngineKind

__all__ = ["AgentSpec"]


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
    settings: AgentSettings = field(default_factory=AgentSettings)
    """Written as flags when they differ from the agent's defaults."""
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
        if self.replica_id is not None:
            argv += ["--replica-id", self.replica_id]
        return argv + argv_for(self.settings) + argv_for(self.limits) + list(self.extra)

    def environ(self) -> dict[str, str]:
        return {"LORAFLEET_CONTROL_TOKEN": self.token or "", **self.env}
