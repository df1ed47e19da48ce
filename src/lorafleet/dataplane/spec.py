"""How ``lorafleet.launch`` starts data-plane copies (``lorafleet dataplane``)."""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet._settings import flags
from lorafleet.dataplane.config import DataPlaneConfig
from lorafleet.launch.process import lorafleet_argv
from lorafleet.launch.specs import SocketServerSpec

__all__ = ["DataPlaneSpec"]


@dataclass(frozen=True, kw_only=True)
class DataPlaneSpec(SocketServerSpec):
    """``lorafleet dataplane``: ``workers`` copies of a router's data plane on one socket."""

    control_url: str
    token: str | None = None
    """The control plane's token (the copies sync with it)."""
    api_key: str | None = None
    """Inference key for the data plane; None: open."""
    agent_token: str | None = None
    """Token to call the agents with; None: the control token."""
    workers: int = 1
    health_interval: float | None = None
    extra: tuple[str, ...] = ()
    name: str = "dataplane"

    def argv(self, fd: int) -> list[str]:
        argv = lorafleet_argv("dataplane", "--control", self.control_url, "--fd", str(fd))
        argv += flags(DataPlaneConfig, workers=self.workers)
        if self.health_interval is not None:
            argv += flags(DataPlaneConfig, health_interval_s=self.health_interval)
        if self.agent_token is not None:
            argv += ["--agent-token", self.agent_token]
        return argv + list(self.extra)

    def environ(self) -> dict[str, str]:
        return {
            "LORAFLEET_CONTROL_TOKEN": self.token or "",
            "LORAFLEET_API_KEY": self.api_key or "",
            **self.env,
        }
