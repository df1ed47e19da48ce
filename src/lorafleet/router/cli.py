"""CLI for the router (placeholder until the component lands)."""

import click


@click.command("router")
def command() -> None:
    """Not implemented yet."""
    raise click.ClickException("the router is not implemented yet")
