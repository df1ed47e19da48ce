"""CLI for the agent (placeholder until the component lands)."""

import click


@click.command("agent")
def command() -> None:
    """Not implemented yet."""
    raise click.ClickException("the agent is not implemented yet")
