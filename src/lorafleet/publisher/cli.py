"""``lorafleet publish``: publish an adapter directory or checkpoint, with per-replica progress."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from lorafleet.protocol.names import MAX_VERSION

DEFAULT_FLEET_DIR = ".lorafleet"


def _targets(
    fleet_dir: str | None, agents: str | None, router: str | None, token: str | None
) -> tuple[list[str], str | None, str | None]:
    if agents:
        return [a.strip() for a in agents.split(",") if a.strip()], router, token
    from lorafleet.fleetfile import FleetNotFound, read_fleet_file

    try:
        info = read_fleet_file(fleet_dir or DEFAULT_FLEET_DIR)
    except FleetNotFound as exc:
        raise click.UsageError(
            f"no --agents given and no fleet found in {fleet_dir or DEFAULT_FLEET_DIR} "
            "(start one with `lorafleet up`)"
        ) from exc
    return info.agent_urls, router or info.router_url, token or info.control_token


def _source(path: str, config_path: str | None):
    """A directory as it is; a state-dict file (native checkpoint) loaded as tensors."""
    config = json.loads(Path(config_path).read_text()) if config_path else None
    p = Path(path)
    if p.is_dir():
        return str(p), config
    if config is None:
        raise click.UsageError("a checkpoint file needs --config (its PEFT adapter config)")
    if p.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return load_file(str(p)), config
    try:
        import torch
    except ImportError as exc:
        raise click.ClickException(f"reading {p.name} needs torch (the engine extra)") from exc
    return torch.load(str(p), map_location="cpu", weights_only=True), config


def _name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from lorafleet.protocol.names import InvalidName, check_name

    try:
        return check_name(value)
    except InvalidName as exc:
        raise click.BadParameter(exc.message) from None


@click.command("publish")
@click.argument("path", type=click.Path(exists=True))
@click.option(
    "--name",
    required=True,
    callback=_name,
    help="Adapter name clients ask for (model=<name>): 1-128 of [A-Za-z0-9._-], "
    "starting with a letter or digit.",
)
@click.option(
    "--version",
    "version",
    type=click.IntRange(1, MAX_VERSION),
    default=None,
    help="Version to publish (default: the active one + 1).",
)
@click.option(
    "--mode",
    type=click.Choice(["atomic", "in_place"]),
    default=None,
    help="atomic (default with a router) or in_place (plain name, upsert).",
)
@click.option(
    "--transfer",
    type=click.Choice(["relay", "remote_upload", "shared_filesystem"]),
    default=None,
    help="relay (default when the agents span hosts): one copy leaves, agents forward it; "
    "remote_upload (default on one host): one copy per agent; shared_filesystem: written once "
    "under --shared-dir.",
)
@click.option(
    "--shared-dir",
    type=click.Path(file_okay=False),
    help="For shared_filesystem: a directory every node sees.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True),
    help="PEFT adapter config JSON for a native-only checkpoint.",
)
@click.option(
    "--fleet",
    "fleet_dir",
    default=None,
    help=f"Data dir of a `lorafleet up` fleet (default {DEFAULT_FLEET_DIR}).",
)
@click.option("--agents", default=None, help="Comma-separated agent URLs (instead of --fleet).")
@click.option("--router", default=None, help="Router URL (enables atomic mode).")
@click.option(
    "--token",
    default=lambda: os.environ.get("LORAFLEET_CONTROL_TOKEN"),
    help="Control token (env LORAFLEET_CONTROL_TOKEN).",
)
@click.option(
    "--keep-versions",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Retention window: this many newest versions stay routable (name@vN, sessions).",
)
@click.option(
    "--max-staleness",
    type=click.IntRange(min=0),
    default=None,
    help="Refuse pins and sessions this many versions behind the newest [default: window-1].",
)
@click.option(
    "--min-replicas",
    default=None,
    help="Quorum: succeed once this many replicas (a count, or a fraction like 0.75) hold the "
    "version; the others lag and catch up from peers [default: every replica].",
)
@click.option(
    "--canary-model",
    default=None,
    help="The base model (a directory or hub id) to compute the trainer's canary with, on CPU "
    "(needs torch and peft): every replica must answer it as this adapter on that model does "
    "before the flip [default: no canary; the application probe alone].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(
    path: str,
    name: str,
    version: int | None,
    mode: str | None,
    transfer: str | None,
    shared_dir: str | None,
    config_path: str | None,
    fleet_dir: str | None,
    agents: str | None,
    router: str | None,
    token: str | None,
    keep_versions: int,
    max_staleness: int | None,
    min_replicas: str | None,
    canary_model: str | None,
    as_json: bool,
) -> None:
    """Publish the adapter at PATH (a PEFT directory or a state-dict file) to every replica."""
    from dataclasses import asdict

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    from lorafleet.errors import LorafleetError, PublishError
    from lorafleet.publisher import Publisher

    quorum = _min_replicas(min_replicas)
    agent_urls, router_url, token = _targets(fleet_dir, agents, router, token)
    source, config = _source(path, config_path)
    console = Console(stderr=True)
    canary = None
    if canary_model is not None:
        if not Path(path).is_dir():
            raise click.BadParameter("needs a PEFT directory as PATH", param_hint="--canary-model")
        from lorafleet.publisher.canary import canary_from_dir

        canary = canary_from_dir(canary_model, path)
    else:
        console.print("canary: none (--canary-model not given); the application probe alone")
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=as_json,
    )
    tasks: dict[str, int] = {}

    def on_progress(replica: str, sent: int, total: int) -> None:
        if replica not in tasks:
            tasks[replica] = progress.add_task(replica, total=total or 1)
        progress.update(tasks[replica], completed=sent, total=total or 1)

    try:
        with (
            progress,
            Publisher(
                agent_urls,
                router=router_url,
                token=token,
                shared_dir=shared_dir,
                on_progress=on_progress,
                # A one-shot command waits for the retirement anyway: report it.
                retire_in_background=False,
            ) as pub,
        ):
            result = pub.publish(
                source,
                name=name,
                version=version,
                mode=mode,
                transfer=transfer,
                config=config,
                keep_versions=keep_versions,
                max_staleness=max_staleness,
                min_replicas=quorum,
                canary=canary,
            )
    except PublishError as exc:
        raise click.ClickException(str(exc)) from exc
    except LorafleetError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    if as_json:
        click.echo(json.dumps(asdict(result), default=str, indent=2))
        return
    click.echo(
        f"published {result.name} v{result.version} ({result.mode}, {result.transfer}) "
        f"as {result.engine_name} in {result.duration_s * 1e3:.0f} ms; "
        f"{result.bytes_sent} bytes sent"
    )
    for rid, t in result.replicas.items():
        click.echo(
            f"  {rid}: upload {t.upload_s * 1e3:.0f} ms ({t.bytes_sent} bytes from here, "
            f"{t.bytes_relayed} relayed), verify {t.verify_s * 1e3:.0f} ms, "
            f"load {t.load_s * 1e3:.0f} ms, {t.files_deduplicated} file(s) deduplicated, "
            f"application {t.application} (probe {t.probe_s * 1e3:.0f} ms)"
            + (f", canary {t.canary.outcome}: {t.canary.detail}" if t.canary else "")
        )
    if result.retired_versions:
        click.echo(f"  retired: {', '.join(f'v{v}' for v in result.retired_versions)}")
    for rid, lag in result.lagging.items():
        click.echo(
            f"  lagging: {rid} since v{lag.since_version} ({lag.reason}); catches up from a peer"
        )
    for w in result.warnings:
        click.echo(f"  warning: {w}")


def parse_min_replicas(text: str | None) -> int | float | None:
    """``--min-replicas`` (the publish command, the front): an integer count or a fraction in
    (0, 1]. Raises ``ValueError`` for anything else."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a count nor a fraction") from None
    if not 0 < value <= 1:
        raise ValueError("a fraction of the replicas is in (0, 1]")
    return value


def _min_replicas(text: str | None) -> int | float | None:
    try:
        return parse_min_replicas(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--min-replicas") from None


class MinReplicas(click.ParamType):
    """``--min-replicas`` as a click type: a count or a fraction (``parse_min_replicas``)."""

    name = "count|fraction"

    def convert(self, value, param, ctx):  # type: ignore[override]
        if value is None or isinstance(value, (int, float)):
            return value
        try:
            return parse_min_replicas(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.command("register")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--name",
    required=True,
    callback=_name,
    help="Adapter name clients ask for (model=<name>).",
)
@click.option("--fleet", "fleet_dir", default=None, help="Fleet directory (default .lorafleet).")
@click.option("--router", default=None, help="Router URL (instead of --fleet).")
@click.option(
    "--token",
    default=lambda: os.environ.get("LORAFLEET_CONTROL_TOKEN"),
    help="Control token (env LORAFLEET_CONTROL_TOKEN).",
)
@click.option(
    "--keep-versions", type=click.IntRange(1, 64), default=2, show_default=True,
    help="Retention window of the name's registered versions.",
)  # fmt: skip
def register_command(
    path: str,
    name: str,
    fleet_dir: str | None,
    router: str | None,
    token: str | None,
    keep_versions: int,
) -> None:
    """Register the PEFT directory PATH by reference: the router reads it once (manifest and
    digest), and a replica copies and verifies it only when a request asks for NAME
    (docs/placement.md). PATH must be under the router's --source-allow (or --watch-dir) and
    readable by the agents (--shared-fs-allow)."""
    import asyncio

    from lorafleet.clients.router import AsyncRouterClient
    from lorafleet.errors import LorafleetError

    if router is None:
        _, router, token = _targets(fleet_dir, None, None, token)
    if router is None:
        raise click.UsageError("registration needs a router (--router, or a fleet with one)")

    async def run():
        async with AsyncRouterClient(router, token) as client:
            return await client.register(name, str(Path(path).resolve()), keep_versions)

    try:
        got = asyncio.run(run())
    except LorafleetError as exc:
        raise click.ClickException(str(exc)) from exc
    what = "registered" if got.created else "already registered (same bytes)"
    click.echo(f"{got.name} v{got.version} {what}: {got.size} bytes, digest {got.digest[:12]}")
