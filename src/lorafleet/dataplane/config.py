"""Data-plane settings, declared once: the router's in-process copy and ``lorafleet dataplane``
both take them (their flags, specs and fleet-file keys derive)."""

from __future__ import annotations

from dataclasses import dataclass

import click

from lorafleet._settings import setting
from lorafleet.protocol.tenants import Tenants

__all__ = ["SERVER_OPTIONS", "DataPlaneConfig", "DataPlaneSettings"]

SERVER_OPTIONS: dict[str, object] = {
    "loop": "uvloop",
    "http": "httptools",
    "lifespan": "on",
    "access_log": False,
    "timeout_keep_alive": 60,
    # The data plane's per-request work: no X-Forwarded-* rewriting (nothing here trusts a
    # client's address), no Server or Date header to build for every answer.
    "proxy_headers": False,
    "server_header": False,
    "date_header": False,
}
"""uvicorn's options for any process that serves the data plane (the router, each copy)."""


@dataclass(kw_only=True)
class DataPlaneSettings:
    """How a data plane watches its replicas and holds its connections and sessions."""

    health_interval_s: float = setting(
        0.5, flag="--health-interval", help="Seconds between health probes of each agent."
    )
    health_timeout_s: float = setting(
        5.0, flag="--health-timeout", help="Seconds an agent may take to answer a probe."
    )
    """A busy machine can take seconds to answer a probe; that alone does not drop a replica."""
    unhealthy_after: int = setting(
        3,
        flag="--unhealthy-after",
        type=click.IntRange(min=1),
        help="Consecutive failed probes or requests that take a replica out of rotation.",
    )
    healthy_after: int = setting(
        2,
        flag="--healthy-after",
        type=click.IntRange(min=1),
        help="Consecutive good probes that bring it back.",
    )
    cold_wait_s: float = setting(
        30.0,
        flag="--cold-wait",
        type=click.FloatRange(min=0),
        help="Seconds a request for a version placed on no replica (cold) waits while the "
        "control plane loads it; past that, 503 adapter_cold with Retry-After (the load goes "
        "on). 0: answer 503 at once and load in the background.",
    )
    grow_at: int = setting(
        0,
        flag="--grow-at",
        type=click.IntRange(min=0),
        help="Requests of one adapter version in flight on the replica a request is sent to at "
        "which the control plane is asked to load that version on one more replica (its "
        "queue grew); 0: never (docs/placement.md).",
    )
    upstream_keepalive_s: float = setting(
        2.0,
        flag="--upstream-keepalive",
        help="Seconds an idle pooled connection to an engine or agent is kept (keep it below the "
        "peers' own keep-alive, 5 s for uvicorn-based servers).",
    )
    """Idle pooled connections to engines and agents are dropped after this: below the 5 s after
    which uvicorn (the reference engine, the agent, vLLM, SGLang) closes them itself."""


@dataclass(kw_only=True)
class DataPlaneConfig(DataPlaneSettings):
    """One ``lorafleet dataplane`` process: where its control plane is, how it serves."""

    control_url: str
    control_token: str | None = None
    """The control plane's token: a copy syncs on its control routes."""
    agent_token: str | None = None
    """Token to call the agents with (health probes); None: the control token."""
    api_key: str | None = None
    """The inference key clients send; None: open."""
    tenants: Tenants | None = None
    """Tenants whose tokens it accepts, each for its own names (``--tenants``)."""
    copy_id: str | None = None
    """How the control plane names this copy (default: host:port#pid)."""
    url: str | None = None
    """Where this copy serves (for ``lorafleet status``)."""
    workers: int = setting(
        1,
        flag="--workers",
        type=click.IntRange(min=1, max=256),
        help="Data-plane copies on this host, sharing one listening socket; one that dies is "
        "started again.",
    )
    stall_s: float = setting(
        1.0,
        flag="--stall-after",
        type=click.FloatRange(min=0.1),
        help="Seconds this process may stop (frozen, starved) before its table counts as "
        "fenced: it then refuses adapter requests until it has synced again.",
    )
