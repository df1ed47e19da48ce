"""``lorafleet inspect``: print a bundle's manifest and its validation result."""

from __future__ import annotations

import json
from pathlib import Path

import click

from lorafleet.errors import BundleError
from lorafleet.rules import ENGINE_KINDS, EngineKind, rulebook


def _load_config(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"cannot read config {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise click.BadParameter(f"{path} must hold a JSON object")
    return cfg


def _bundle_from_file(path: Path, config: dict, name: str, version: int):
    """A native checkpoint file: a .safetensors or torch state dict of LoRA tensors."""
    from lorafleet.bundle import AdapterBundle

    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(path))
    else:
        try:
            import torch
        except ImportError as exc:
            raise click.ClickException(
                f"reading {path.name} needs torch (the engine extra)"
            ) from exc
        tensors = torch.load(str(path), map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict):
            raise click.ClickException(f"{path} does not hold a state dict")
    return AdapterBundle.from_state_dict(tensors, config, name=name, version=version)


@click.command("inspect")
@click.argument("path", type=click.Path(exists=True))
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="PEFT adapter config (JSON) for a native-only checkpoint.",
)
@click.option("--name", default="adapter", show_default=True)
@click.option("--version", "version", default=1, show_default=True, type=int)
@click.option("--max-rank", type=int, default=None, help="The engine's max_lora_rank.")
@click.option(
    "--engine",
    type=click.Choice(ENGINE_KINDS),
    default=None,
    help="Validate with this engine kind's rules (default: what every engine kind refuses).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect_command(
    path: str,
    config_path: str | None,
    name: str,
    version: int,
    max_rank: int | None,
    engine: EngineKind | None,
    as_json: bool,
) -> None:
    """Print the manifest of the adapter at PATH and validate it (exit 1 if invalid).

    PATH is a PEFT adapter directory, a native-only directory or a state-dict file
    (.safetensors, .pt, .bin); the last two need --config.
    """
    from lorafleet.bundle import AdapterBundle, validate_adapter_dir

    config = _load_config(config_path)
    p = Path(path)
    try:
        if p.is_dir():
            report = validate_adapter_dir(p, config=config, max_rank=max_rank, engine=engine)
            bundle = None
            if report.ok:
                bundle = AdapterBundle.from_dir(p, name=name, version=version, config=config)
        else:
            if config is None:
                raise click.UsageError("a checkpoint file needs --config")
            bundle = _bundle_from_file(p, config, name, version)
            report = bundle.validate(max_rank=max_rank, engine=engine)
            report.preloadable = False  # a bare file is never an engine-readable directory
    except BundleError as exc:
        raise click.ClickException(str(exc)) from exc

    if as_json:
        click.echo(
            json.dumps(
                {
                    "manifest": bundle.manifest.model_dump(mode="json") if bundle else None,
                    "digest": bundle.digest if bundle else None,
                    "rules": rulebook(engine).kind,
                    "valid": report.ok,
                    "preloadable": report.preloadable,
                    "problems": report.problems,
                    "rank": report.rank,
                    "tensors": report.tensors,
                },
                indent=2,
            )
        )
    else:
        click.echo(f"adapter:     {path}")
        if bundle is not None:
            click.echo(f"name:        {bundle.name}  version {bundle.version}")
            click.echo(f"base model:  {bundle.base_model}")
            click.echo(f"digest:      sha256:{bundle.digest}")
            click.echo("files:")
            for f in bundle.files:
                click.echo(f"  {f.path:<28} {f.size:>12} B  sha256:{f.sha256}")
        click.echo(f"rank:        {report.rank}   tensors: {report.tensors}")
        click.echo(f"rules:       {rulebook(engine).source}")
        click.echo(f"preloadable: {'yes' if report.preloadable else 'no'}")
        if report.ok:
            click.echo("valid:       yes")
        else:
            click.echo("valid:       NO", err=False)
            for problem in report.problems:
                click.echo(f"  - {problem}")
    if not report.ok:
        raise SystemExit(1)
