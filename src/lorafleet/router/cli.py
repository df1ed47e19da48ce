"""``lorafleet router``: the adapter-aware, version-consistent front door."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from lorafleet._settings import click_options, from_options
from lorafleet.launch.listen import (
    api_key_option,
    control_token_option,
    listen_options,
    tenants_option,
)

if TYPE_CHECKING:
    from lorafleet.protocol.tenants import Tenants

__all__ = ["command"]


def _router_config_options(f):
    from lorafleet.router.config import RouterConfig

    return click_options(RouterConfig)(f)


@click.command("router")
@click.option("--agents", required=True, help="Comma-separated agent URLs, one per replica.")
@listen_options(8200)
@control_token_option("Bearer token for /v1/control/* (env LORAFLEET_CONTROL_TOKEN).")
@api_key_option("Inference key for the data plane (env LORAFLEET_API_KEY); optional.")
@tenants_option(
    "A tenants file (TOML, or JSON): each tenant's token may name only its own adapters on the "
    "data plane; read at start (docs/tenants.md)."
)
@click.option("--agent-token", default=None, help="Token to call agents (default: control token).")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Persist the alias table here (reloaded at startup); one router per directory.",
)
@_router_config_options
@click.option("--log-level", default="warning", show_default=True)
def command(
    agents: str,
    host: str,
    port: int,
    fd: int | None,
    control_token: str | None,
    api_key: str | None,
    tenants: Tenants | None,
    agent_token: str | None,
    state_dir: str | None,
    log_level: str,
    **options,
) -> None:
    """Route OpenAI-style generation to replicas by adapter version."""
    from lorafleet._dirlock import DirectoryLocked, lock_directory
    from lorafleet.dataplane.config import SERVER_OPTIONS
    from lorafleet.launch.listen import listen_address, serve
    from lorafleet.router.app import RouterConfig, create_app

    urls = [u.strip() for u in agents.split(",") if u.strip()]
    if not urls:
        raise click.UsageError("--agents needs at least one URL")
    host, port = listen_address(host, port, fd)
    # Two routers persisting one alias table would overwrite each other's flips.
    lock = None
    if state_dir is not None:
        try:
            lock = lock_directory(state_dir, holder=f"lorafleet router on {host}:{port}")
        except DirectoryLocked as exc:
            raise click.ClickException(str(exc)) from exc
    if control_token is None and os.environ.get("LORAFLEET_CONTROL_TOKEN") == "":
        control_token = None
    config = from_options(
        RouterConfig,
        options,
        agents=urls,
        control_token=control_token or None,
        api_key=api_key or None,
        tenants=tenants,
        agent_token=agent_token or control_token or None,
        state_dir=state_dir,
    )
    app = create_app(config)
    try:
        serve(
            app,
            host=host,
            port=port,
            fd=fd,
            log_level=log_level,
            **SERVER_OPTIONS,
        )
    finally:
        if lock is not None:
            lock.release()
