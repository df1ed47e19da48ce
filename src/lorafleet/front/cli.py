"""``lorafleet front``: a server's API over a lorafleet fleet, for unmodified trainers."""

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


def _config_options(f):
    from lorafleet.front.service import FrontConfig

    return click_options(FrontConfig)(f)


def _upload_options(f):
    from lorafleet.front.uploads import UploadDirLimits

    return click_options(UploadDirLimits)(f)


def _default_dialect() -> str:
    from lorafleet.front.service import FrontConfig

    return FrontConfig.dialect


def _dialect_names() -> list[str]:
    from lorafleet.front.dialects import DIALECTS

    return list(DIALECTS)


def _help() -> str:
    """The command's help: every dialect in the registry with its summary, so a dialect added
    there is listed here without an edit."""
    from lorafleet.front.dialects import DIALECTS

    width = max(map(len, DIALECTS))
    # "\b": click keeps the list's lines as they are instead of rewrapping them into one.
    lines = [f"  {d.name:<{width}}  {d.summary}" for d in DIALECTS.values()]
    return (
        "Speak one inference server's API over a fleet: loads become publications.\n\n"
        "\b\nDialects (--dialect):\n" + "\n".join(lines)
    )


@click.command("front", help=_help())
@click.option("--agents", required=True, help="Comma-separated agent URLs, one per replica.")
@click.option("--router", required=True, help="The lorafleet router's URL.")
@click.option(
    "--shared-dir",
    "shared_dirs",
    multiple=True,
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="A directory trainers load adapters from (repeatable); every other lora_path is "
    "refused. The first also holds the hand-over to the agents, who must allow it.",
)
@listen_options(8000)
@control_token_option(
    "The fleet's control token: the agents' and the router's (env LORAFLEET_CONTROL_TOKEN)."
)
@api_key_option("The router's inference key, sent on forwarded generation (env LORAFLEET_API_KEY).")
@click.option(
    "--trainer-token",
    envvar="LORAFLEET_FRONT_TOKEN",
    default=None,
    help="Bearer token trainers send on control calls (env LORAFLEET_FRONT_TOKEN; default: the "
    "control token).",
)
@tenants_option(
    "A tenants file (TOML, or JSON): each tenant's token is accepted as a trainer token for its "
    "own adapter names only, within its quotas; the trainer token stays the operator's "
    "(docs/tenants.md)."
)
@click.option(
    "--allow-unauthenticated-control",
    is_flag=True,
    help="Accept control calls without a token, from --control-allow-from addresses only "
    "(TRL sends none).",
)
@click.option(
    "--control-allow-from",
    default="127.0.0.1,::1",
    show_default=True,
    help="Comma-separated addresses or networks allowed to call control without a token.",
)
@_config_options
@click.option(
    "--dialect",
    type=click.Choice(_dialect_names()),
    default=_default_dialect(),
    show_default=True,
    help="Which server's API to speak (lorafleet.front.dialects).",
)
@click.option(
    "--upload-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Stage remote uploads here (the skyrl dialect's PUT /skyrl/v1/lora-adapters/...); its "
    "skyrl-uploads/ subdirectory is the front's and is emptied at start. Default: uploads off.",
)
@_upload_options
@click.option("--log-level", default="warning", show_default=True)
def command(
    agents: str,
    router: str,
    shared_dirs: tuple[str, ...],
    host: str,
    port: int,
    fd: int | None,
    control_token: str | None,
    api_key: str | None,
    trainer_token: str | None,
    tenants: Tenants | None,
    allow_unauthenticated_control: bool,
    control_allow_from: str,
    dialect: str,
    upload_dir: str | None,
    log_level: str,
    **options,
) -> None:
    """Run the front (its help text is ``_help()``, built from the dialect registry)."""
    from pathlib import Path

    from lorafleet.front.app import create_app
    from lorafleet.front.service import FrontConfig, parse_networks
    from lorafleet.front.uploads import UploadDirLimits
    from lorafleet.launch.listen import listen_address, serve

    urls = [u.strip() for u in agents.split(",") if u.strip()]
    if not urls:
        raise click.UsageError("--agents needs at least one URL")
    tokens = control_token or trainer_token or os.environ.get("LORAFLEET_FRONT_TOKEN") or tenants
    if not tokens and not allow_unauthenticated_control:
        raise click.UsageError(
            "give --trainer-token (or --control-token), or --allow-unauthenticated-control"
        )
    try:
        networks = parse_networks(control_allow_from.split(","))
        upload_limits = from_options(UploadDirLimits, options)
        cfg = from_options(
            FrontConfig,
            options,
            agents=urls,
            router=router,
            shared_dirs=[Path(d) for d in shared_dirs],
            fleet_token=control_token or None,
            api_key=api_key or None,
            trainer_token=trainer_token or None,
            tenants=tenants,
            allow_unauthenticated_control=allow_unauthenticated_control,
            control_allow_from=networks,
            dialect=dialect,
            upload_dir=Path(upload_dir) if upload_dir else None,
            upload_limits=upload_limits,
        )
        app = create_app(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    host, port = listen_address(host, port, fd)
    serve(app, host=host, port=port, fd=fd, lifespan="on", access_log=False, log_level=log_level)
