"""The agent's routes, one module per group (each a FastAPI ``APIRouter``).

``uploads``: verified upload sessions; ``adapters``: register, load, verify, activate, unload,
send (catch-up) and the listing; ``reads``: info, health and metrics. Each group's
``routes(ctx)`` takes one ``AgentRoutes``: the runtime and the dependencies its routes use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorafleet.agent.runtime import Runtime

__all__ = ["AgentRoutes"]


@dataclass(frozen=True)
class AgentRoutes:
    """What the route groups share: ``guard`` (the control token) on every mutating route,
    ``ctl`` the statuses it adds to their documentation, and ``upload_access``, the dependency
    that admits the control token or a session's relay credential."""

    rt: Runtime
    guard: list[Any]
    ctl: tuple[int, ...]
    upload_access: Callable[..., bool]
