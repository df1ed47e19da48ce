"""``lorafleet status``: ask a running fleet how it is, and render it with rich tables.

Collection and rendering are separate: ``collect_status`` returns plain data (also printed by
``--json``), ``render_status`` turns it into tables. A component that does not answer is shown as
such, never as an exception.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.fleetfile import FleetInfo, pid_alive

__all__ = ["FleetStatus", "ReplicaView", "collect_status", "render_status"]

_TIMEOUT = 3.0


@dataclass
class ReplicaView:
    index: int
    engine: str
    agent_url: str
    engine_url: str
    replica_id: str | None = None
    healthy: bool = False
    health_detail: str | None = None
    inflight: int | None = None
    adapters: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FleetStatus:
    router_url: str
    router_healthy: bool
    up_pid: int | None
    up_alive: bool
    replicas: list[ReplicaView]
    aliases: list[dict[str, Any]]
    inflight_total: int | None
    copies: list[dict[str, Any]] = field(default_factory=list)
    """The router's data-plane copies (``CopyStatus``): table seq, current or fenced, load."""
    table_seq: int | None = None
    catch_up: list[dict[str, Any]] = field(default_factory=list)
    """The relay trees the router's catch-up is feeding now (``CatchUpTree``)."""
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _get(client: httpx.Client, url: str, errors: list[str], **kw: Any) -> httpx.Response | None:
    try:
        return client.get(url, **kw)
    except httpx.HTTPError as exc:
        errors.append(f"{url}: {type(exc).__name__}")
        return None


def _inflight_from_metrics(text: str) -> dict[tuple[str, str], float]:
    """The router's ``lorafleet_router_inflight`` gauge, by (adapter, version).

    Unparseable exposition text counts as no samples: status shows "?" rather than failing.
    """
    out: dict[tuple[str, str], float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name != "lorafleet_router_inflight":
                continue
            for sample in family.samples:
                key = (sample.labels.get("adapter", ""), sample.labels.get("version", ""))
                out[key] = sample.value
    except ValueError:
        return {}
    return out


def collect_status(info: FleetInfo) -> FleetStatus:
    """Query the router and every agent of the fleet in ``info`` (short timeouts)."""
    errors: list[str] = []
    auth = {"Authorization": f"Bearer {info.control_token}"}
    replicas = [
        ReplicaView(index=i, engine=r.engine, agent_url=r.agent_url, engine_url=r.engine_url)
        for i, r in enumerate(info.replicas)
    ]
    aliases: list[dict[str, Any]] = []
    inflight_total: int | None = None
    with httpx.Client(timeout=_TIMEOUT) as client:
        for view in replicas:
            health = _get(client, view.agent_url + "/health", errors)
            if health is not None:
                view.healthy = health.status_code == 200
                try:
                    view.health_detail = health.json().get("detail")
                except ValueError:
                    view.health_detail = f"HTTP {health.status_code}"
            agent_info = _get(client, view.agent_url + "/v1/info", errors)
            if agent_info is not None and agent_info.status_code == 200:
                view.replica_id = agent_info.json().get("replica_id")
            listing = _get(client, view.agent_url + "/v1/adapters", errors, headers=auth)
            if listing is not None and listing.status_code == 200:
                view.adapters = listing.json().get("adapters", [])
            elif listing is not None:
                errors.append(f"{view.agent_url}/v1/adapters: HTTP {listing.status_code}")

        health = _get(client, info.router_url + "/health", errors)
        router_healthy = health is not None and health.status_code == 200
        table = _get(client, info.router_url + "/v1/control/aliases", errors, headers=auth)
        if table is not None and table.status_code == 200:
            aliases = sorted(table.json().get("aliases", {}).values(), key=lambda a: a["name"])
        routed = _get(client, info.router_url + "/v1/control/replicas", errors, headers=auth)
        if routed is not None and routed.status_code == 200:
            by_agent = {r["agent_url"].rstrip("/"): r for r in routed.json().get("replicas", [])}
            for view in replicas:
                seen = by_agent.get(view.agent_url.rstrip("/"))
                if seen is not None:
                    view.inflight = int(seen.get("inflight", 0))
                    view.replica_id = view.replica_id or seen.get("replica_id")
        copies: list[dict[str, Any]] = []
        table_seq = None
        listed = _get(client, info.router_url + "/v1/control/copies", errors, headers=auth)
        if listed is not None and listed.status_code == 200:
            copies, table_seq = listed.json().get("copies", []), listed.json().get("seq")
        trees: list[dict[str, Any]] = []
        feeding = _get(client, info.router_url + "/v1/control/catch-up", errors, headers=auth)
        if feeding is not None and feeding.status_code == 200:
            trees = feeding.json().get("trees", [])
        metrics = _get(client, info.router_url + "/metrics", errors)
        if metrics is not None and metrics.status_code == 200:
            gauges = _inflight_from_metrics(metrics.text)
            if gauges:
                inflight_total = int(sum(gauges.values()))
            for a in aliases:
                a["inflight"] = int(gauges.get((a["name"], str(a["version"])), 0))
        if inflight_total is None and any(v.inflight is not None for v in replicas):
            inflight_total = sum(v.inflight or 0 for v in replicas)
    return FleetStatus(
        router_url=info.router_url,
        router_healthy=router_healthy,
        up_pid=info.pid,
        up_alive=pid_alive(info.pid),
        replicas=replicas,
        aliases=aliases,
        inflight_total=inflight_total,
        copies=copies,
        table_seq=table_seq,
        catch_up=trees,
        errors=errors,
    )


def _yes(ok: bool) -> str:
    return "[green]healthy[/green]" if ok else "[red]unhealthy[/red]"


def render_status(status: FleetStatus, info: FleetInfo) -> list[Any]:
    """Rich renderables: fleet summary, replicas, adapters per replica, active versions."""
    from rich.table import Table

    fleet = Table(title="lorafleet", show_header=False, title_justify="left")
    fleet.add_column("key", style="bold")
    fleet.add_column("value")
    fleet.add_row("router", f"{status.router_url}  {_yes(status.router_healthy)}")
    if info.dataplane_url:
        fleet.add_row("data plane", f"{info.dataplane_url} ({len(status.copies)} copies)")
    fleet.add_row("supervisor pid", f"{status.up_pid} ({'running' if status.up_alive else 'gone'})")
    fleet.add_row("data dir", info.data_dir)
    fleet.add_row("base model", f"{info.served_model_name} ({info.model})")
    fleet.add_row("in-flight", "?" if status.inflight_total is None else str(status.inflight_total))

    replicas = Table(title="replicas", title_justify="left")
    replicas.add_column("replica", no_wrap=True)
    replicas.add_column("engine")
    replicas.add_column("engine url", overflow="fold")
    replicas.add_column("health", no_wrap=True)
    replicas.add_column("in-flight", justify="right")
    replicas.add_column("adapters", justify="right")
    for v in status.replicas:
        health = _yes(v.healthy)
        if not v.healthy and v.health_detail:
            health += f" ({v.health_detail})"
        replicas.add_row(
            v.replica_id or v.agent_url,
            v.engine,
            v.engine_url,
            health,
            "?" if v.inflight is None else str(v.inflight),
            str(len(v.adapters)),
        )

    adapters = Table(title="adapters on replicas", title_justify="left")
    # The canary column only where a version was proven by one: the table stays narrow.
    canaries = any(a.get("canary") for v in status.replicas for a in v.adapters)
    cols = ["replica", "name", "version", "engine name", "state", "applied", "digest"]
    if canaries:
        cols.insert(-1, "canary")
    for col in cols:
        adapters.add_column(col)
    for v in status.replicas:
        for a in sorted(v.adapters, key=lambda a: (a.get("name", ""), a.get("version", 0))):
            row = [
                v.replica_id or str(v.index),
                str(a.get("name")),
                str(a.get("version")),
                str(a.get("engine_name")),
                str(a.get("state")),
                str(a.get("application") or "-"),  # the engine's proof (agent/probe.py)
                str(a.get("digest", ""))[:19],
            ]
            if canaries:
                row.insert(-1, _canary(a.get("canary")))
            adapters.add_row(*row)

    active = Table(title="active versions (router aliases)", title_justify="left")
    # The placement column only where a name was placed on some replicas (docs/placement.md).
    placed = any(a.get("placement") is not None for a in status.aliases)
    cols = ["name", "version", "engine name", "replicas", "in-flight"]
    if placed:
        cols.insert(4, "placement")
    for col in cols:
        active.add_column(col, overflow="fold")
    for a in status.aliases:
        # A version no replica holds is cold: the next request for it loads it.
        row = [
            a["name"],
            str(a["version"]),
            a["engine_name"],
            ", ".join(a["replicas"]) or "[yellow]cold (loaded on demand)[/yellow]",
            str(a.get("inflight", "?")),
        ]
        if placed:
            where = a.get("placement")
            row.insert(4, "every replica" if where is None else ", ".join(where) or "none")
        active.add_row(*row)

    out: list[Any] = [fleet, replicas, adapters, active]
    if status.copies:
        # The data plane as clients reach it: each copy routes by the table seq it acknowledged.
        copies = Table(
            title=f"data-plane copies (table seq {status.table_seq})", title_justify="left"
        )
        for col in ("copy", "url", "table", "state", "in-flight", "replicas up", "requests"):
            copies.add_column(col, overflow="fold")
        for c in status.copies:
            state = (
                "[red]fenced[/red]"
                if c["fenced"]
                else "[green]current[/green]"
                if c["current"]
                else f"[yellow]silent {c['last_sync_s']:.1f}s[/yellow]"
            )
            copies.add_row(
                c["copy_id"],
                str(c.get("url") or "-"),
                str(c["acked"]),
                state,
                str(c["inflight"]),
                str(c["healthy_replicas"]),
                str(c["requests"]),
            )
        out.append(copies)
    lagging = [
        (a["name"], rid, lag) for a in status.aliases for rid, lag in a.get("lagging", {}).items()
    ]
    if lagging:
        # A quorum publication went on without these; the router catches them up from a peer.
        lag_table = Table(title="lagging replicas (serve none of the name)", title_justify="left")
        for col in ("name", "replica", "since", "failures", "next retry", "why"):
            lag_table.add_column(col, overflow="fold")
        now = time.time()
        for name, rid, lag in sorted(lagging, key=lambda x: (x[0], x[1])):
            wait = lag.get("retry_at", 0) - now
            lag_table.add_row(
                name,
                rid,
                f"v{lag.get('since_version')}",
                str(lag.get("failures", 1)),
                f"in {wait:.0f}s" if wait > 0 else "now",
                str(lag.get("reason", "")),
            )
        out.append(lag_table)
    if status.catch_up:
        # Replicas that lost a version together, fed through relay trees of peers.
        trees = Table(title="catching up (relay trees from peers)", title_justify="left")
        for col in ("name", "version", "from", "fed"):
            trees.add_column(col)
        for t in status.catch_up:
            trees.add_row(
                t["name"], f"v{t['version']}", t["source"], f"{t['fed']} of {t['replicas']}"
            )
        out.append(trees)
    if status.errors:
        out.append("[yellow]unreachable:[/yellow] " + "; ".join(status.errors))
    return out


def _canary(verdict: dict | None) -> str:
    """The trainer's canary on that replica (protocol/canary.py): outcome and mean |Δ log p|
    against the trainer and the base."""
    if not verdict:
        return "-"
    return (
        f"{verdict['outcome']} ({verdict['mean_vs_trainer']:.2g} vs trainer, "
        f"{verdict['mean_vs_base']:.2g} vs base)"
    )
