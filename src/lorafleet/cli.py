"""The ``lorafleet`` command line. Each component owns its subcommand in ``<component>/cli.py``."""

from __future__ import annotations

import click

from lorafleet.agent.cli import command as agent_command
from lorafleet.bundle.cli import inspect_command
from lorafleet.dataplane.cli import command as dataplane_command
from lorafleet.engine.cli import command as engine_command
from lorafleet.fleet.cli import demo_command, status_command, up_command
from lorafleet.front.cli import command as front_command
from lorafleet.publisher.cli import command as publish_command
from lorafleet.publisher.cli import register_command
from lorafleet.router.cli import command as router_command


@click.group()
@click.version_option(package_name="lorafleet")
def main() -> None:
    """Move LoRA adapters into inference fleets, verified and atomic, and route by version."""


@main.command("tiny-model")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--cached", is_flag=True, help="Use (and fill) the shared cache; print its path.")
def tiny_model(directory: str | None, cached: bool) -> None:
    """Write the deterministic tiny Llama model (and tokenizer) into DIRECTORY."""
    from lorafleet.tinymodel import ensure_tiny_model, write_tiny_model

    if directory is None and not cached:
        raise click.UsageError("give a DIRECTORY or --cached")
    path = ensure_tiny_model(directory) if cached else write_tiny_model(directory)
    click.echo(str(path))


for _cmd in (
    agent_command,
    inspect_command,
    engine_command,
    publish_command,
    register_command,
    router_command,
    dataplane_command,
    front_command,
    up_command,
    status_command,
    demo_command,
):
    main.add_command(_cmd)
