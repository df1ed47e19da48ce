"""``lorafleet agent``: one agent in front of one engine."""

from __future__ import annotations

import os
import secrets

import click

from lorafleet.agent.uploads import UploadLimits
from lorafleet.engine_kinds import ENGINE_KINDS, all_options, engine_kind
from lorafleet.launch.listen import fd_option

_GiB = 1 << 30


def engine_options(f):
    """Every engine kind's own flags (``lorafleet.engine_kinds``), as click options."""
    for kind, opt in reversed(all_options()):
        f = click.option(opt.flag, opt.key, is_flag=True, help=f"[{kind.name}] {opt.help}")(f)
    return f


def _options_for(engine: str, given: dict[str, bool]) -> dict[str, bool]:
    """The flags set for ``engine``; another kind's flag is a usage error."""
    own = {o.key for o in engine_kind(engine).options}
    for kind, opt in all_options():
        if given.get(opt.key) and opt.key not in own:
            raise click.UsageError(f"{opt.flag} is a {kind.name} option; --engine is {engine}")
    return {k: v for k, v in given.items() if k in own and v}


@click.command("agent")
@click.option("--engine", "engine", type=click.Choice(ENGINE_KINDS), required=True)
@click.option(
    "--engine-url", required=True, help="Base URL of the engine, e.g. http://127.0.0.1:8000"
)
@click.option(
    "--data-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Adapter store; one agent per directory.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8100, show_default=True, type=int)
@fd_option
@click.option(
    "--control-token",
    envvar="LORAFLEET_CONTROL_TOKEN",
    default=None,
    help="Bearer token for mutating routes (generated and printed if absent).",
)
@click.option("--replica-id", default=None, help="Default: host:port (of the --fd socket).")
@click.option("--served-model-name", default=None, help="Default: discovered from the engine.")
@click.option("--max-file-bytes", default=128 * _GiB, show_default=True, type=int)
@click.option("--quota-bytes", default=None, type=int, help="Default: free disk minus 1 GiB.")
@click.option(
    "--direct-io-min-bytes",
    default=64 << 20,
    show_default=True,
    type=click.IntRange(min=0),
    help="Files this large are written with O_DIRECT, past the page cache; 0: never.",
)
@click.option(
    "--upload-ttl",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds an idle upload session lives.",
)
@click.option(
    "--shared-fs-allow",
    multiple=True,
    type=click.Path(),
    help="Directory /v1/adapters/register may read from (repeatable).",
)
@click.option("--max-lora-rank", default=None, type=int, help="Override the engine's limit.")
@click.option("--max-adapters", default=None, type=int, help="Override the engine's limit.")
@engine_options
@click.option("--log-level", default="info", show_default=True)
def command(
    engine: str,
    engine_url: str,
    data_dir: str,
    host: str,
    port: int,
    fd: int | None,
    control_token: str | None,
    replica_id: str | None,
    served_model_name: str | None,
    max_file_bytes: int,
    quota_bytes: int | None,
    direct_io_min_bytes: int,
    upload_ttl: float,
    shared_fs_allow: tuple[str, ...],
    max_lora_rank: int | None,
    max_adapters: int | None,
    log_level: str,
    **options: bool,
) -> None:
    """Run the agent: verified uploads, a durable adapter store, engine loading, reconciliation."""
    own_options = _options_for(engine, options)
    import logging

    from lorafleet._dirlock import DirectoryLocked, lock_directory
    from lorafleet.agent.app import AgentConfig, create_app
    from lorafleet.launch.listen import listen_address, serve

    host, port = listen_address(host, port, fd)
    # Taken before the app opens the store: a second agent would corrupt the first one's state.
    try:
        lock = lock_directory(data_dir, holder=f"lorafleet agent on {host}:{port}")
    except DirectoryLocked as exc:
        raise click.ClickException(str(exc)) from exc
    if not control_token:
        control_token = secrets.token_urlsafe(24)
        click.echo(f"lorafleet agent: generated control token: {control_token}", err=True)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    # httpx logs every request at INFO: the reconciler's engine listing, twice a second. Those
    # lines belong to --log-level debug.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = AgentConfig(
        engine=engine,
        engine_url=engine_url,
        data_dir=os.path.abspath(data_dir),
        token=control_token,
        replica_id=replica_id or f"{host}:{port}",
        served_model_name=served_model_name,
        limits=UploadLimits(
            max_file_bytes=max_file_bytes,
            quota_bytes=quota_bytes,
            ttl_s=upload_ttl,
            direct_io_min_bytes=direct_io_min_bytes or None,
        ),
        shared_fs_allow=list(shared_fs_allow),
        max_lora_rank=max_lora_rank,
        max_adapters=max_adapters,
        engine_options=own_options,
    )
    try:
        serve(
            create_app(cfg),
            host=host,
            port=port,
            fd=fd,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    finally:
        lock.release()
