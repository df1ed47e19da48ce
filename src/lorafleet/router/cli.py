"""``lorafleet router``: the adapter-aware, version-consistent front door."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from lorafleet.launch.listen import fd_option

if TYPE_CHECKING:
    from lorafleet.router.proxy import Proxy

__all__ = ["command"]


@click.command("router")
@click.option("--agents", required=True, help="Comma-separated agent URLs, one per replica.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8200, show_default=True, type=int)
@fd_option
@click.option(
    "--control-token",
    envvar="LORAFLEET_CONTROL_TOKEN",
    default=None,
    help="Bearer token for /v1/control/* (env LORAFLEET_CONTROL_TOKEN).",
)
@click.option(
    "--api-key",
    envvar="LORAFLEET_API_KEY",
    default=None,
    help="Inference key for the data plane (env LORAFLEET_API_KEY); optional.",
)
@click.option("--agent-token", default=None, help="Token to call agents (default: control token).")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Persist the alias table here (reloaded at startup); one router per directory.",
)
@click.option("--health-interval", default=0.5, show_default=True, type=float)
@click.option(
    "--health-timeout",
    default=5.0,
    show_default=True,
    type=float,
    help="Seconds an agent may take to answer a probe.",
)
@click.option(
    "--unhealthy-after",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Consecutive failed probes or requests that take a replica out of rotation.",
)
@click.option(
    "--healthy-after",
    default=2,
    show_default=True,
    type=click.IntRange(min=1),
    help="Consecutive good probes that bring it back.",
)
@click.option(
    "--upstream-keepalive",
    default=2.0,
    show_default=True,
    type=float,
    help="Seconds an idle pooled connection to an engine or agent is kept (keep it below the "
    "peers' own keep-alive, 5 s for uvicorn-based servers).",
)
@click.option(
    "--catch-up-interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds between catch-up rounds: a replica that lacks a routable version is fed from "
    "a peer that holds it (docs/quorum.md); 0 turns catch-up off.",
)
@click.option("--log-level", default="warning", show_default=True)
def command(
    agents: str,
    host: str,
    port: int,
    fd: int | None,
    control_token: str | None,
    api_key: str | None,
    agent_token: str | None,
    state_dir: str | None,
    health_interval: float,
    health_timeout: float,
    unhealthy_after: int,
    healthy_after: int,
    upstream_keepalive: float,
    catch_up_interval: float,
    log_level: str,
    *,
    proxy_class: Callable[..., Proxy] | None = None,
) -> None:
    """Route OpenAI-style generation to replicas by adapter version."""
    from lorafleet._dirlock import DirectoryLocked, lock_directory
    from lorafleet.launch.listen import listen_address, serve
    from lorafleet.router.app import RouterConfig, create_app
    from lorafleet.router.proxy import Proxy

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
    config = RouterConfig(
        agents=urls,
        control_token=control_token or None,
        api_key=api_key or None,
        agent_token=agent_token or control_token or None,
        state_dir=state_dir,
        health_interval_s=health_interval,
        health_timeout_s=health_timeout,
        unhealthy_after=unhealthy_after,
        healthy_after=healthy_after,
        upstream_keepalive_s=upstream_keepalive,
        catch_up_interval_s=catch_up_interval,
    )
    app = create_app(config, proxy_class=proxy_class or Proxy)
    try:
        serve(
            app,
            host=host,
            port=port,
            fd=fd,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            log_level=log_level,
            timeout_keep_alive=60,
        )
    finally:
        if lock is not None:
            lock.release()
