"""``lorafleet up``, ``lorafleet status`` and ``lorafleet demo``.

Torch-free at import: the demo's trainer is imported only when the demo runs.
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click

from lorafleet.fleet.config import DEFAULT_DATA_DIR

if TYPE_CHECKING:
    from rich.console import Console

    from lorafleet.fleet.local import LocalFleet

__all__ = ["demo_command", "status_command", "up_command"]


class Stopped(Exception):
    """SIGINT or SIGTERM arrived: shut the fleet down."""


def raise_stopped(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum).name)


@click.command("up")
@click.argument("fleet_file", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Logs, agent stores, router state and fleet.json; one fleet per directory "
    f"[default: {DEFAULT_DATA_DIR}].",
)
@click.option(
    "--engines",
    type=click.IntRange(min=1),
    default=None,
    help="Reference engines in the embedded default fleet [default: 2].",
)
@click.option(
    "--ray",
    "on_ray",
    is_flag=True,
    help="Deploy onto a Ray cluster instead (needs lorafleet[ray]): a replica per node.",
)
@click.option(
    "--address",
    default=None,
    help="With --ray: the cluster to connect to [default: auto, the local one].",
)
@click.option(
    "--namespace",
    default="lorafleet",
    show_default=True,
    help="With --ray: the Ray namespace the fleet's actors are named in.",
)
def up_command(
    fleet_file: str | None,
    data_dir: str | None,
    engines: int | None,
    on_ray: bool,
    address: str | None,
    namespace: str,
) -> None:
    """Start a local fleet (engines, one agent each, a router) and keep it up until Ctrl-C.

    With no FLEET_FILE: reference engines on the tiny model. A FLEET_FILE (TOML) can instead put
    agents in front of running vLLM or SGLang servers; see ``lorafleet.fleet.config``. With
    --ray the fleet runs on a Ray cluster (reference engines only from the command line; attach
    to a trainer's engines with ``lorafleet.ray.attach_engines``).
    """
    from rich.console import Console

    from lorafleet._dirlock import DirectoryLocked
    from lorafleet.fleet.config import FleetConfigError, load_fleet_config
    from lorafleet.fleet.local import LocalFleet

    try:
        config = load_fleet_config(fleet_file, engines=engines, data_dir=data_dir)
    except FleetConfigError as exc:
        raise click.UsageError(str(exc)) from exc

    console = Console()
    if on_ray:
        # Ray sits above the local fleet (it reuses its fleet file and status): it is named
        # by a string resolved here, not imported.
        try:
            ray_cli = importlib.import_module("lorafleet.ray.cli")
        except ImportError as exc:
            raise click.ClickException("--ray needs Ray: pip install 'lorafleet[ray]'") from exc
        ray_cli.up_on_ray(console, config, address, namespace)
        return
    if address is not None:
        raise click.UsageError("--address needs --ray")
    fleet = LocalFleet(config, on_event=lambda m: console.print(f"[dim]{m}[/dim]"))
    # Ctrl-C and SIGTERM both unwind through the same path; children run in their own sessions,
    # so only this process receives the terminal's SIGINT and it stops them in order.
    previous = {s: signal.signal(s, raise_stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        fleet.start()
        path = fleet.write_fleet_file()
        _print_banner(console, fleet, path)
        _supervise(console, fleet)
    except Stopped as stop:
        console.print(f"\n{stop}: stopping the fleet…")
    except DirectoryLocked as exc:  # another fleet runs from this data dir; nothing started
        raise click.ClickException(str(exc)) from exc
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        # A second Ctrl-C must not abort the shutdown halfway and leave orphans.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        fleet.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    console.print("fleet stopped")


def _print_banner(console: Console, fleet: LocalFleet, path: Path) -> None:
    from rich.table import Table

    t = Table(title="lorafleet is up", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    if fleet.dataplane_url is not None:
        copies = fleet.config.router.copies
        t.add_row(f"data plane, {copies} copies (OpenAI API)", fleet.dataplane_url + "/v1")
        t.add_row("router (control plane)", fleet.router_url)
    else:
        t.add_row("router (OpenAI API)", fleet.router_url + "/v1")
    t.add_row("inference API key", fleet.api_key or "(none)")
    t.add_row("control token", fleet.token)
    for i, (agent, engine) in enumerate(zip(fleet.agent_urls, fleet.engine_urls, strict=True)):
        t.add_row(f"replica {i}", f"agent {agent}  →  engine {engine}")
    t.add_row("data dir", str(fleet.data_dir))
    t.add_row("fleet file", f"{path} (0600)")
    console.print(t)
    console.print(
        "publish with [bold]lorafleet publish --fleet "
        f"{fleet.data_dir} ...[/bold]; inspect with [bold]lorafleet status --data-dir "
        f"{fleet.data_dir}[/bold]; Ctrl-C stops everything."
    )


def _supervise(console: Console, fleet: LocalFleet) -> None:
    """Wait for a signal; report (once) any fleet process that dies on its own."""
    reported: set[str] = set()
    while True:
        time.sleep(1.0)  # the signal handler raises Stopped out of here
        for name in fleet.dead():
            if name not in reported:
                reported.add(name)
                console.print(f"[red]{name} exited; see {fleet.data_dir / 'logs'}[/red]")


@click.command("status")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=DEFAULT_DATA_DIR,
    show_default=True,
    help="The data directory the fleet was started with.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead.")
def status_command(data_dir: str, as_json: bool) -> None:
    """Show a running fleet: replicas, health, adapters, active versions, in-flight requests."""
    from rich.console import Console

    from lorafleet.fleet.status import collect_status, render_status
    from lorafleet.fleetfile import FleetNotFound, read_fleet_file

    try:
        info = read_fleet_file(data_dir)
    except (FleetNotFound, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    status = collect_status(info)
    if as_json:
        click.echo(json.dumps(status.to_json(), indent=2))
    else:
        # Piped output (logs, tests) gets full-width tables instead of 80 truncated columns.
        console = Console(width=None if sys.stdout.isatty() else 120)
        for renderable in render_status(status, info):
            console.print(renderable)
    if not status.router_healthy or not all(r.healthy for r in status.replicas):
        sys.exit(1)


@click.command("demo")
@click.option("--steps", type=click.IntRange(min=2), default=12, show_default=True)
@click.option(
    "--resume",
    is_flag=True,
    help="Mid-run, kill the engines (new agents too) and resume from a native-only checkpoint.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the demo fleet's state and logs here [default: a temporary directory].",
)
@click.option(
    "--async",
    "async_",
    is_flag=True,
    help="Asynchronous RL: rollouts run while the trainer publishes every step (window of 3).",
)
@click.option(
    "--json-summary",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the run's summary (steps, rewards, latencies, resume check) as JSON.",
)
def demo_command(
    steps: int, resume: bool, async_: bool, data_dir: str | None, json_summary: str | None
) -> None:
    """Train a LoRA skill on CPU, publish it every step, and watch the reward rise via the router.

    Exits non-zero if the reward did not rise (or, with --resume, serving was not restored; with
    --async, a rollout request failed or a sample came from outside the retention window).
    """
    from lorafleet.fleet.demo import run_demo, write_summary

    if async_ and resume:
        raise click.UsageError("--async and --resume are separate demos")
    if async_:
        from lorafleet.fleet.demo_async import run_async_demo

        summary = run_async_demo(steps=steps, data_dir=data_dir)
    else:
        summary = run_demo(steps=steps, resume=resume, data_dir=data_dir)
    if json_summary:
        write_summary(summary, json_summary)
    if not summary.ok:
        sys.exit(1)
