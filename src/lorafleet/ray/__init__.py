"""lorafleet on Ray: deploy a fleet onto a cluster, or attach agents to a trainer's engines.

Needs the ``ray`` extra (``pip install 'lorafleet[ray]'``); the rest of lorafleet never imports
Ray. Connect first (``ray.init(...)``), then::

    from lorafleet.ray import deploy

    fleet = deploy(2, engine="reference", namespace="rl")   # engine + agent per node, a router
    with fleet.publisher() as pub:
        pub.publish(adapter_dir, name="policy")
    # clients: fleet.router_url + "/v1", model="policy", key fleet.api_key

Anywhere on the cluster, later: ``lorafleet.ray.attach("rl")`` finds the same fleet.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("lorafleet.ray needs Ray: pip install 'lorafleet[ray]'") from exc

from lorafleet.ray.fleet import (
    DEFAULT_NAMESPACE,
    EngineOnRay,
    RayFleet,
    RayReplica,
    attach,
    attach_engines,
    deploy,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "EngineOnRay",
    "RayFleet",
    "RayReplica",
    "attach",
    "attach_engines",
    "deploy",
]
