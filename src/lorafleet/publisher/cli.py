"""CLI for the publisher (placeholder until the component lands)."""

import click


@click.command("publish")
def command() -> None:
    """Not implemented yet."""
    raise click.ClickException("the publisher is not implemented yet")
