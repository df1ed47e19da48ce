"""``RouterConfig``: every router setting, declared once (flags and specs derive)."""

from __future__ import annotations

from dataclasses import dataclass, field

import click

from lorafleet._settings import setting
from lorafleet.dataplane.config import DataPlaneSettings
from lorafleet.protocol.tenants import Tenants

__all__ = ["RouterConfig"]


@dataclass(kw_only=True)
class RouterConfig(DataPlaneSettings):
    """The router: the control plane and its in-process data-plane copy (whose settings are
    ``DataPlaneSettings``)."""

    agents: list[str]
    control_token: str | None = None
    api_key: str | None = None
    tenants: Tenants | None = None
    """Tenants whose tokens the data plane accepts, each for its own names (``--tenants``)."""
    agent_token: str | None = None
    state_dir: str | None = None
    catch_up_interval_s: float = setting(
        1.0,
        flag="--catch-up-interval",
        type=click.FloatRange(min=0),
        help="Seconds between catch-up rounds: a replica that lacks a routable version is fed "
        "from a peer that holds it (docs/quorum.md); 0 turns catch-up off.",
    )
    """How often the router compares each replica's adapters with the table and feeds a
    lagging or empty one from a peer (``router/catchup.py``)."""
    copy_lease_s: float = setting(
        2.0,
        flag="--copy-lease",
        type=click.FloatRange(min=0.2),
        help="Seconds a data-plane copy's table stays current after its last sync; a flip waits "
        "at most this long (plus a margin) for a copy that does not acknowledge it.",
    )
    session_idle_s: float = setting(
        3600.0,
        flag="--session-idle",
        type=click.FloatRange(min=1),
        help="Seconds a session (X-Session-ID) may stay idle before its next request starts "
        "fresh, on the newest version (a lost finish_session does not pin it for good).",
    )
    shrink_after_s: float = setting(
        300.0,
        flag="--shrink-after",
        type=click.FloatRange(min=0),
        help="Seconds a version loaded on a replica on demand (cold, or for a queue that grew) "
        "may stay unasked-for before it is evicted there again (drained first); 0 keeps it "
        "until its slot is needed. Replicas a publication chose are never shrunk.",
    )
    watch_dirs: list[str] = setting(
        flag="--watch-dir",
        multiple=True,
        type=click.Path(file_okay=False),
        default_factory=list,
        help="Directory whose subdirectories are registered by reference under their own names "
        "(repeatable; docs/placement.md). The agents must read it (--shared-fs-allow).",
    )
    source_allow: list[str] = setting(
        flag="--source-allow",
        multiple=True,
        type=click.Path(file_okay=False),
        default_factory=list,
        help="Directory under which /v1/control/registrations may name adapter directories "
        "(repeatable).",
    )
    extra: dict = field(default_factory=dict)
