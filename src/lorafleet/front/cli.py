"""``lorafleet front``: a server's API over a lorafleet fleet, for unmodified trainers."""

from __future__ import annotations

import os

import click

from lorafleet.launch.listen import fd_option

__all__ = ["command"]


def _dialect_names() -> list[str]:
    from lorafleet.front.dialects import DIALECTS

    return list(DIALECTS)


@click.command("front")
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
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@fd_option
@click.option(
    "--control-token",
    envvar="LORAFLEET_CONTROL_TOKEN",
    default=None,
    help="The fleet's control token: the agents' and the router's (env LORAFLEET_CONTROL_TOKEN).",
)
@click.option(
    "--api-key",
    envvar="LORAFLEET_API_KEY",
    default=None,
    help="The router's inference key, sent on forwarded generation (env LORAFLEET_API_KEY).",
)
@click.option(
    "--trainer-token",
    envvar="LORAFLEET_FRONT_TOKEN",
    default=None,
    help="Bearer token trainers send on control calls (env LORAFLEET_FRONT_TOKEN; default: the "
    "control token).",
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
@click.option(
    "--name-pattern",
    default=r"^(?P<name>.+)-v(?P<version>\d+)$",
    show_default=True,
    help="Regex with groups name and version: trl-policy-v7 is trl-policy version 7. A name it "
    "does not match is the next version of that name.",
)
@click.option(
    "--keep-versions",
    default=2,
    show_default=True,
    type=click.IntRange(min=1),
    help="Versions of a name kept routable (the retention window).",
)
@click.option(
    "--min-replicas",
    default=None,
    help="Quorum for each publication: a count or a fraction like 0.75 (docs/quorum.md) "
    "[default: every replica].",
)
@click.option("--dtype", default=None, help="dtype /server_info reports (default: the model's).")
@click.option(
    "--dialect",
    type=click.Choice(_dialect_names()),
    default="vllm",
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
@click.option(
    "--upload-max-file-bytes",
    type=click.IntRange(min=1),
    default=128 << 30,
    show_default=True,
    help="Per-file cap of a remote upload (a larger declared size is a 413).",
)
@click.option(
    "--upload-quota-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="All staged uploads together (default: the free disk).",
)
@click.option(
    "--upload-ttl",
    type=click.FloatRange(min=0.1),
    default=600.0,
    show_default=True,
    help="Seconds an upload may sit idle (no PUT, no load) before it is reaped.",
)
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
    allow_unauthenticated_control: bool,
    control_allow_from: str,
    name_pattern: str,
    keep_versions: int,
    min_replicas: str | None,
    dtype: str | None,
    dialect: str,
    upload_dir: str | None,
    upload_max_file_bytes: int,
    upload_quota_bytes: int | None,
    upload_ttl: float,
    log_level: str,
) -> None:
    """Speak one inference server's API over a fleet (--dialect vllm: TRL, prime-rl, AReaL;
    sglang: AReaL): loads become publications."""
    from pathlib import Path

    from lorafleet.front.app import create_app
    from lorafleet.front.service import FrontConfig, parse_networks
    from lorafleet.front.uploads import UploadDirLimits
    from lorafleet.launch.listen import listen_address, serve
    from lorafleet.publisher.cli import parse_min_replicas

    urls = [u.strip() for u in agents.split(",") if u.strip()]
    if not urls:
        raise click.UsageError("--agents needs at least one URL")
    if not (control_token or trainer_token or os.environ.get("LORAFLEET_FRONT_TOKEN")) and not (
        allow_unauthenticated_control
    ):
        raise click.UsageError(
            "give --trainer-token (or --control-token), or --allow-unauthenticated-control"
        )
    try:
        networks = parse_networks(control_allow_from.split(","))
        cfg = FrontConfig(
            agents=urls,
            router=router,
            shared_dirs=[Path(d) for d in shared_dirs],
            fleet_token=control_token or None,
            api_key=api_key or None,
            trainer_token=trainer_token or None,
            allow_unauthenticated_control=allow_unauthenticated_control,
            control_allow_from=networks,
            name_pattern=name_pattern,
            keep_versions=keep_versions,
            min_replicas=parse_min_replicas(min_replicas),
            dtype=dtype,
            dialect=dialect,
            upload_dir=Path(upload_dir) if upload_dir else None,
            upload_limits=UploadDirLimits(
                max_file_bytes=upload_max_file_bytes,
                quota_bytes=upload_quota_bytes,
                ttl_s=upload_ttl,
            ),
        )
        app = create_app(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    host, port = listen_address(host, port, fd)
    serve(app, host=host, port=port, fd=fd, lifespan="on", access_log=False, log_level=log_level)
