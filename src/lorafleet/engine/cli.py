"""CLI for the engine (placeholder until the component lands)."""

import click


@click.command("engine")
def command() -> None:
    """Not implemented yet."""
    raise click.ClickException("the engine is not implemented yet")
