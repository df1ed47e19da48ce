"""How ``lorafleet.launch`` starts a router (``lorafleet router``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet._settings import flags
from lorafleet.launch.process import lorafleet_argv
from lorafleet.launch.specs import SocketServerSpec
from lorafleet.router.config import RouterConfig

__all__ = ["RouterSpec"]


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
