"""The one name rule: what an adapter name, an engine name, a lease holder and a version may be.

Every place that takes a name from outside uses this module: the bundle's manifest, the agent's
request bodies, the router's control plane (path parameters and bodies) and data plane (``model``),
the Publisher and the CLI. A name ends up in file paths on the agents, in engine-side names
(``<name>@v<version>``, SGLang's ``<base>:<name>``), in response headers and in metric labels, so
the rule is a full match over a small, documented character set with a length cap:

- **adapter name**: 1-128 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit
  (``NAME_PATTERN``). No ``/``, ``:``, ``@``, whitespace, control characters or non-ASCII.
- **engine name**: an adapter name, optionally followed by ``@v<version>`` (``policy@v7``).
- **lease holder**: 1-256 characters of ``[A-Za-z0-9._:@-]``, starting with a letter or digit
  (the Publisher's default is ``<host>:<pid>:<hex>``).
- **version**: an integer from 1 to ``MAX_VERSION`` (2**63 - 1: what SQLite's INTEGER holds).

Refusals raise ``InvalidName`` (400 ``invalid_name``), which is also a ``ValueError``, so pydantic
validators and FastAPI's parameter validation report it with its precise code.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from lorafleet.errors import InvalidName

__all__ = [
    "ENGINE_NAME_PATTERN",
    "HOLDER_MAX",
    "HOLDER_PATTERN",
    "MAX_VERSION",
    "NAME_MAX",
    "NAME_PATTERN",
    "AdapterName",
    "EngineName",
    "InvalidName",
    "LeaseHolder",
    "Version",
    "check_engine_name",
    "check_holder",
    "check_name",
    "is_valid_name",
]

NAME_MAX = 128
HOLDER_MAX = 256
MAX_VERSION = 2**63 - 1
"""The largest version: SQLite's INTEGER (the agent's state) is a signed 64-bit integer."""

NAME_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}}"
ENGINE_NAME_PATTERN = rf"{NAME_PATTERN}(?:@v[1-9][0-9]{{0,18}})?"
HOLDER_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9._:@-]{{0,{HOLDER_MAX - 1}}}"

_NAME = re.compile(NAME_PATTERN)
_ENGINE_NAME = re.compile(ENGINE_NAME_PATTERN)
_HOLDER = re.compile(HOLDER_PATTERN)


def _shown(value: object) -> str:
    """``value`` for an error message: repr'd (no raw control characters), and cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_valid_name(value: object) -> bool:
    """Whether ``value`` is a valid adapter name (never raises)."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def check_name(value: object, *, param: str = "name") -> str:
    """Return ``value`` if it is a valid adapter name; raise ``InvalidName`` otherwise."""
    if not is_valid_name(value):
        raise InvalidName(
            f"invalid adapter name {_shown(value)}: use 1-{NAME_MAX} characters of "
            "[A-Za-z0-9._-], starting with a letter or digit",
            param=param,
        )
    return value  # type: ignore[return-value]


def check_engine_name(value: object, *, param: str = "engine_name") -> str:
    """Return ``value`` if it is an adapter name, optionally with ``@v<version>``."""
    if not isinstance(value, str) or _ENGINE_NAME.fullmatch(value) is None:
        raise InvalidName(
            f"invalid engine name {_shown(value)}: an adapter name, optionally followed by "
            "'@v<version>'",
            param=param,
        )
    return value


def check_holder(value: object, *, param: str = "holder") -> str:
    """Return ``value`` if it is a valid lease holder; raise ``InvalidName`` otherwise."""
    if not isinstance(value, str) or _HOLDER.fullmatch(value) is None:
        raise InvalidName(
            f"invalid lease holder {_shown(value)}: use 1-{HOLDER_MAX} characters of "
            "[A-Za-z0-9._:@-], starting with a letter or digit",
            param=param,
        )
    return value


# Pydantic types for wire models and FastAPI parameters. The JSON schema documents the rule
# (ECMA-262 ``^...$`` anchors match the whole string); the validator enforces it with its code.
AdapterName = Annotated[
    str,
    Field(json_schema_extra={"pattern": f"^{NAME_PATTERN}$", "maxLength": NAME_MAX}),
    AfterValidator(check_name),
]
EngineName = Annotated[
    str,
    Field(json_schema_extra={"pattern": f"^{ENGINE_NAME_PATTERN}$", "maxLength": NAME_MAX + 21}),
    AfterValidator(check_engine_name),
]
LeaseHolder = Annotated[
    str,
    Field(json_schema_extra={"pattern": f"^{HOLDER_PATTERN}$", "maxLength": HOLDER_MAX}),
    AfterValidator(check_holder),
]
Version = Annotated[int, Field(ge=1, le=MAX_VERSION)]
