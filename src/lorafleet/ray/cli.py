"""``lorafleet up --ray``: the fleet on a Ray cluster, from the command line."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import click
import ray
from rich.console import Console

from lorafleet.fleet.cli import Stopped, raise_stopped
from lorafleet.fleet.config import FleetConfig
from lorafleet.ray.fleet import RayFleet, deploy

__all__ = ["up_on_ray"]


def up_on_ray(console: Console, config: FleetConfig, address: str | None, namespace: str) -> None:
    """``lorafleet up --ray``: deploy, write fleet.json, wait for Ctrl-C, shut the fleet down."""
    if any(not r.managed_engine for r in config.replicas):
        raise click.UsageError(
            "--ray starts reference engines; attach agents to running engines on Ray with "
            "lorafleet.ray.attach_engines"
        )
    first = config.replicas[0]
    ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)
    console.print(f"[dim]deploying {len(config.replicas)} replicas on Ray ({namespace})[/dim]")
    previous = {s: signal.signal(s, raise_stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    fleet = None
    data_dir = Path(config.data_dir).absolute()
    try:
        fleet = deploy(
            len(config.replicas),
            model=config.model,
            engine_args={
                "served_model_name": config.served_model_name,
                "max_loras": first.max_loras,
                "max_lora_rank": first.max_lora_rank,
            },
            agent_args={"settings": first.agent, "limits": first.limits},
            namespace=namespace,
            token=config.control_token,
            api_key=config.api_key,
            copies_per_node=config.router.copies,
        )
        path = fleet.write_fleet_file(data_dir, pid=os.getpid())
        _print_banner(console, fleet, path)
        seen = (fleet.router_url, fleet.agent_urls)
        while True:
            time.sleep(5.0)  # the signal handler raises Stopped out of here
            # A replica re-placed after a node loss answers elsewhere: keep fleet.json true.
            if (fleet.refresh().router_url, fleet.agent_urls) != seen:
                seen = (fleet.router_url, fleet.agent_urls)
                fleet.write_fleet_file(data_dir, pid=os.getpid())
                console.print(f"[yellow]a replica moved: agents {', '.join(seen[1])}[/yellow]")
    except Stopped as stop:
        console.print(f"\n{stop}: stopping the fleet…")
    except (RuntimeError, TimeoutError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        if fleet is not None:
            fleet.shutdown()
            from lorafleet.fleetfile import remove_fleet_file

            remove_fleet_file(data_dir, owner_pid=os.getpid())
        for s, handler in previous.items():
            signal.signal(s, handler)
    console.print("fleet stopped")


def _print_banner(console: Console, fleet: RayFleet, path: Path) -> None:
    from rich.table import Table

    t = Table(title="lorafleet is up on Ray", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    if fleet.dataplane_urls:
        t.add_row("data plane (OpenAI API)", ", ".join(u + "/v1" for u in fleet.dataplane_urls))
        t.add_row("router (control plane)", fleet.router_url)
    else:
        t.add_row("router (OpenAI API)", fleet.router_url + "/v1")
    t.add_row("inference API key", fleet.api_key or "(none)")
    t.add_row("control token", fleet.token)
    for r in fleet.replicas:
        t.add_row(
            f"replica {r.index}",
            f"agent {r.agent_url}  →  engine {r.engine_url}  (node {r.node_id[:12]})",
        )
    t.add_row("namespace", f"{fleet.namespace} (lorafleet.ray.attach finds it)")
    t.add_row("fleet file", f"{path} (0600)")
    console.print(t)
    console.print(
        f"publish with [bold]lorafleet publish --fleet {path.parent} ...[/bold]; inspect with "
        f"[bold]lorafleet status --data-dir {path.parent}[/bold]; Ctrl-C stops everything."
    )
