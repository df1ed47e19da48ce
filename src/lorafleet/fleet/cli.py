"""CLI for the local fleet (placeholder until the component lands)."""

import click


@click.command("up")
def up_command() -> None:
    """Not implemented yet."""
    raise click.ClickException("not implemented yet")


@click.command("status")
def status_command() -> None:
    """Not implemented yet."""
    raise click.ClickException("not implemented yet")


@click.command("demo")
def demo_command() -> None:
    """Not implemented yet."""
    raise click.ClickException("not implemented yet")
