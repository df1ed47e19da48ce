"""HTTP clients of lorafleet's own services, over the wire protocol (``lorafleet.protocol``).

``AsyncAgentClient`` drives one agent; ``AsyncRouterClient`` the router's control plane. The
Publisher, the router's catch-up, the fronts and the CLIs all use these: the services themselves
never import each other.
"""

from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.clients.router import NO_CAS, AsyncRouterClient

__all__ = ["NO_CAS", "AsyncAgentClient", "AsyncRouterClient"]
