"""``lorafleet agent``: one agent in front of one engine.

The options come from the settings they fill (``AgentConfig``, ``UploadLimits``, each engine
kind's own flags): a new agent setting is one field there.
"""

from __future__ import annotations

import os
import secrets

import click

from lorafleet._settings import click_options, from_options
from lorafleet.agent.limits import UploadLimits
from lorafleet.engine_kinds import ENGINE_KINDS, all_options, engine_kind
from lorafleet.launch.listen import control_token_option, listen_options


def engine_options(f):
    """Every engine kind's own flags (``lorafleet.engine_kinds``), as click options."""
    for kind, opt in reversed(all_options()):
        f = click.option(opt.flag, opt.key, is_flag=True, help=f"[{kind.name}] {opt.help}")(f)
    return f


def _options_for(engine: str, given: dict[str, bool]) -> dict[str, bool]:
    """The flags set for ``engine`` (popped from ``given``); another kind's is a usage error."""
    own = {o.key for o in engine_kind(engine).options}
    out = {}
    for kind, opt in all_options():
        if given.pop(opt.key, False):
            if opt.key not in own:
                raise click.UsageError(f"{opt.flag} is a {kind.name} option; --engine is {engine}")
            out[opt.key] = True
    return out


def _agent_config_options(f):
    from lorafleet.agent.config import AgentConfig

    return click_options(AgentConfig)(f)


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
@listen_options(8100)
@control_token_option("Bearer token for mutating routes (generated and printed if absent).")
@click.option("--replica-id", default=None, help="Default: host:port (of the --fd socket).")
@_agent_config_options
@click_options(UploadLimits)
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
    log_level: str,
    **options,
) -> None:
    """Run the agent: verified uploads, a durable adapter store, engine loading, reconciliation."""
    import logging

    from lorafleet._dirlock import DirectoryLocked, lock_directory
    from lorafleet.agent._body import upload_http_protocol
    from lorafleet.agent.app import AgentConfig, create_app
    from lorafleet.launch.listen import listen_address, serve

    own_options = _options_for(engine, options)
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
    limits = from_options(UploadLimits, options)
    cfg = from_options(
        AgentConfig,
        options,
        engine=engine,
        engine_url=engine_url,
        data_dir=os.path.abspath(data_dir),
        token=control_token,
        replica_id=replica_id or f"{host}:{port}",
        limits=limits,
        engine_options=own_options,
    )
    assert not options, f"options without a setting: {sorted(options)}"
    try:
        serve(
            create_app(cfg),
            host=host,
            port=port,
            fd=fd,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
            # Uploads' bodies straight into their buffers (where uvicorn is a tested version).
            http=upload_http_protocol() or "auto",
        )
    finally:
        lock.release()
