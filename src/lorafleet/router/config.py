"""``RouterConfig``: every router setting, declared once (flags and specs derive)."""

from __future__ import annotations

from dataclasses import dataclass, field

import click

from lorafleet._settings import setting

__all__ = ["RouterConfig"]


@dataclass
class RouterConfig:
    agents: list[str]
    control_token: str | None = None
    api_key: str | None = None
    agent_token: str | None = None
    state_dir: str | None = None
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
    upstream_keepalive_s: float = setting(
        2.0,
        flag="--upstream-keepalive",
        help="Seconds an idle pooled connection to an engine or agent is kept (keep it below the "
        "peers' own keep-alive, 5 s for uvicorn-based servers).",
    )
    catch_up_interval_s: float = setting(
        1.0,
        flag="--catch-up-interval",
        type=click.FloatRange(min=0),
        help="Seconds between catch-up rounds: a replica that lacks a routable version is fed "
        "from a peer that holds it (docs/quorum.md); 0 turns catch-up off.",
    )
    """How often the router compares each replica's adapters with the table and feeds a
    lagging or empty one from a peer (``router/catchup.py``)."""
    session_idle_s: float = setting(
        3600.0,
        flag="--session-idle",
        type=click.FloatRange(min=1),
        help="Seconds a session (X-Session-ID) may stay idle before its next request starts "
        "fresh, on the newest version (a lost finish_session does not pin it for good).",
    )
    """Idle pooled connections to engines and agents are dropped after this: below the 5 s after
    which uvicorn (the reference engine, the agent, vLLM, SGLang) closes them itself."""
    extra: dict = field(default_factory=dict)
