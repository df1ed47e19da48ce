"""Settings dataclasses as the one source of a service's options.

A settings field declared with ``setting(default, flag=..., help=...)`` is a command-line option
of the service (``click_options``), a flag its launch spec writes when the value differs from the
default (``argv_for``), and a key of the fleet file (the dataclass is a pydantic field there). The
default is written once, on the field.

    @dataclass(frozen=True)
    class Limits:
        max_file_bytes: int = setting(128 << 30, flag="--max-file-bytes", help="...")

    @click.command()
    @click_options(Limits)
    def main(**kw): limits = from_options(Limits, kw)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import click

__all__ = ["argv_for", "click_options", "flags", "from_options", "setting"]

_KEY = "lorafleet.cli"


@dataclass(frozen=True)
class _Cli:
    flag: str
    help: str
    type: Any
    multiple: bool
    none_as: Any
    """The command line's spelling of None (``--direct-io-min-bytes 0``: never)."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    flag: str,
    help: str,
    type: Any = None,
    multiple: bool = False,
    none_as: Any = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is also the option ``flag``."""
    meta = {_KEY: _Cli(flag, help, type, multiple, none_as)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _settings(cls: type) -> Iterator[tuple[dataclasses.Field, _Cli]]:
    for f in dataclasses.fields(cls):
        cli = f.metadata.get(_KEY)
        if cli is not None:
            yield f, cli


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def click_options(cls: type) -> Callable[[Callable], Callable]:
    """A decorator adding one click option per ``setting`` of ``cls`` (parameter: the field)."""

    def decorate(fn: Callable) -> Callable:
        for f, cli in reversed(list(_settings(cls))):
            default = _default(f)
            shown = cli.none_as if default is None else default
            kw: dict[str, Any] = {"help": cli.help}
            if cli.multiple:
                kw["multiple"] = True
            elif default is dataclasses.MISSING:
                kw["required"] = True
            elif isinstance(default, bool):
                kw["is_flag"] = True
            else:
                kw["default"] = shown
                kw["show_default"] = shown is not None
            if cli.type is not None:
                kw["type"] = cli.type
            elif not cli.multiple and isinstance(default, (int, float)):
                kw["type"] = type(default)
            fn = click.option(cli.flag, f.name, **kw)(fn)
        return fn

    return decorate


def from_options(cls: type, options: dict[str, Any], **more: Any) -> Any:
    """``cls`` from the parsed options its settings declared (popped from ``options``)."""
    kw: dict[str, Any] = {}
    for f, cli in _settings(cls):
        if f.name not in options:
            continue
        value = options.pop(f.name)
        if cli.multiple:
            value = list(value)
        elif cli.none_as is not None and value == cli.none_as:
            value = None
        kw[f.name] = value
    return cls(**kw, **more)


def argv_for(obj: Any) -> list[str]:
    """The flags that make a service's settings equal ``obj``: only those off their default."""
    return flags(type(obj), **{f.name: getattr(obj, f.name) for f, _cli in _settings(type(obj))})


def flags(cls: type, **values: Any) -> list[str]:
    """The flags that give these settings of ``cls`` these values: only those off their
    default. A launch spec that holds a few of a service's settings writes them with this."""
    known = {f.name: (f, cli) for f, cli in _settings(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(unknown)}")
    argv: list[str] = []
    for name, value in values.items():
        f, cli = known[name]
        if cli.multiple:
            for item in value:
                argv += [cli.flag, str(item)]
            continue
        if value == _default(f):
            continue
        if isinstance(value, bool):
            if value:
                argv.append(cli.flag)
            continue
        argv += [cli.flag, str(cli.none_as if value is None else value)]
    return argv
