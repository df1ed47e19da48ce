"""CLI: ``lorafleet inspect`` (placeholder)."""

import click


@click.command("inspect")
def inspect_command() -> None:
    """Not implemented yet."""
    raise click.ClickException("not implemented yet")
