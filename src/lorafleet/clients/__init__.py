"""HTTP clients of lorafleet's own services, over the wire protocol (``lorafleet.protocol``).

``AsyncAgentClient`` drives one agent; ``AsyncRouterClient`` the router's control plane (and the
data-plane calls lorafleet makes itself, with the inference key). The Publisher, the router's
catch-up, the fronts and the CLIs all use these: the services themselves never import each other.
"""

from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.clients.router import NO_CAS, AsyncRouterClient

# Plain sorted order, as tests/test_public_api.py requires; ruff's RUF022 wants isort order.
__all__ = ["AsyncAgentClient", "AsyncRouterClient", "NO_CAS"]  # noqa: RUF022
