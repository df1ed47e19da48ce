"""The fleet file (``fleet.toml``): what ``lorafleet up`` starts. Small on purpose.

Every key is optional; an empty file (or no file) is the embedded default: two reference engines on
the tiny model, one agent each, and a router. Unknown keys are refused, so a typo fails early.

```toml
[fleet]
data_dir = ".lorafleet"        # logs, agent stores, router state, fleet.json
host = "127.0.0.1"             # every process binds here
model = "/models/tiny"         # base model of the reference engines (default: the tiny model)
served_model_name = "tiny"
control_token = "..."          # default: generated with `secrets` at start
api_key = "..."                # inference key for the router; default generated, "" = none

[router]
port = 8000                    # default: a free port
copies = 2                     # data-plane copies on one socket (default 0: the router serves)
data_port = 8100               # where the copies listen (default: a free port)

[[replica]]                    # lorafleet starts a reference engine and its agent
engine = "reference"
max_loras = 8
max_lora_rank = 64

[[replica]]                    # an engine you run (vLLM with runtime LoRA, or SGLang):
engine = "vllm"                # lorafleet starts only the agent in front of it
url = "http://127.0.0.1:8001"
agent_port = 9001              # default: a free port
```
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lorafleet.agent.config import AgentSettings
from lorafleet.agent.limits import UploadLimits
from lorafleet.engine_kinds import EngineKind, engine_kind

__all__ = [
    "DEFAULT_DATA_DIR",
    "EngineKind",
    "FleetConfig",
    "FleetConfigError",
    "ReplicaConfig",
    "RouterSection",
    "load_fleet_config",
]

DEFAULT_DATA_DIR = ".lorafleet"
_Port = Field(default=0, ge=0, le=65535)


class FleetConfigError(ValueError):
    """The fleet file is malformed (the message names the key)."""


class _Model(BaseModel):
    # Unknown keys are refused, so a typo fails early instead of being ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaConfig(_Model):
    """One ``[[replica]]``: an engine and the agent in front of it."""

    engine: EngineKind = "reference"
    url: str | None = None
    """An existing engine to put an agent in front of; required for vllm and sglang."""
    agent_port: int = _Port
    engine_port: int = _Port
    """Port of the reference engine lorafleet starts (0: a free one)."""
    max_loras: int = Field(default=8, ge=1)
    max_lora_rank: int = Field(default=64, ge=1)
    limits: UploadLimits = UploadLimits()
    """``[replica.limits]``: the agent's upload limits (``lorafleet agent`` options)."""
    agent: AgentSettings = AgentSettings()
    """``[replica.agent]``: the agent's other settings (``lorafleet agent`` options)."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, not {url!r}")
        return url

    @model_validator(mode="after")
    def _external_engine_has_url(self) -> ReplicaConfig:
        if not engine_kind(self.engine).embedded and not self.url:
            raise ValueError(f"a {self.engine} replica needs url = 'http://host:port'")
        return self

    @property
    def managed_engine(self) -> bool:
        """True when lorafleet starts (and restarts) this replica's engine itself."""
        return engine_kind(self.engine).embedded and self.url is None


class RouterSection(_Model):
    """``[router]``: the control plane, and its data-plane copies (docs/router.md)."""

    port: int = _Port
    copies: int = Field(default=0, ge=0, le=256)
    """Data-plane copies (``lorafleet dataplane --workers``) clients go to; 0: the router's
    own in-process data plane serves them."""
    data_port: int = _Port
    """Where the copies listen (one socket they share)."""


class FleetConfig(_Model):
    """What ``LocalFleet`` runs: the ``[fleet]`` table, ``[router]`` and the replicas."""

    data_dir: Path = Path(DEFAULT_DATA_DIR)
    host: str = "127.0.0.1"
    model: Path | None = None
    """Base model of the reference engines; None means the tiny model (generated once, cached)."""
    served_model_name: str = "tiny"
    control_token: str | None = None
    api_key: str | None = None
    """None: generate one; "": no inference key."""
    router: RouterSection = RouterSection()
    replicas: tuple[ReplicaConfig, ...] = ()

    @field_validator("data_dir", "model")
    @classmethod
    def _expand_user(cls, path: Path | None) -> Path | None:
        return path.expanduser() if path is not None else None

    @classmethod
    def default(cls, engines: int = 2, **overrides: Any) -> FleetConfig:
        """The embedded default: ``engines`` reference engines on the tiny model."""
        if engines < 1:
            raise FleetConfigError("a fleet needs at least one engine")
        return cls(replicas=tuple(ReplicaConfig() for _ in range(engines)), **overrides)


class _FleetTable(_Model):
    """``[fleet]``: the keys of ``FleetConfig`` a file may set (types checked again there)."""

    data_dir: Path | None = None
    host: str | None = None
    model: Path | None = None
    served_model_name: str | None = None
    control_token: str | None = None
    api_key: str | None = None


class _FleetFile(_Model):
    fleet: _FleetTable = _FleetTable()
    router: RouterSection = RouterSection()
    replica: list[ReplicaConfig] = []


def _where(loc: tuple[int | str, ...]) -> tuple[str, str]:
    """(table, key) of an error location, e.g. ("[[replica]] #2", "engine")."""
    if not loc:
        return "the fleet file", ""
    if loc[0] == "replica" and len(loc) > 1 and isinstance(loc[1], int):
        return f"[[replica]] #{loc[1] + 1}", ".".join(str(p) for p in loc[2:])
    table = "[[replica]]" if loc[0] == "replica" else f"[{loc[0]}]"
    return table, ".".join(str(p) for p in loc[1:])


def _message(err: Any) -> str:
    loc = tuple(err["loc"])
    table, key = _where(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return f"unknown table [{loc[0]}]"
        return f"unknown key {key!r} in {table}"
    if kind == "literal_error":
        return f"{table}: {key} must be one of {err['ctx']['expected']}, not {err['input']!r}"
    if kind == "value_error":
        return f"{table}: {err['ctx']['error']}"
    if not key and kind in ("model_type", "dict_type"):
        return f"{table} must be a table"
    if loc == ("replica",) and kind == "list_type":
        return "replica must be an array of tables: [[replica]]"
    return f"{table}: {key + ': ' if key else ''}{err['msg']}"


def _config_error(exc: ValidationError) -> FleetConfigError:
    return FleetConfigError("; ".join(_message(e) for e in exc.errors()))


def load_fleet_config(
    path: str | os.PathLike | None, *, engines: int | None = None, data_dir: str | None = None
) -> FleetConfig:
    """Read ``path`` (None: the embedded default). ``engines``/``data_dir`` override the file.

    ``engines`` sets the number of reference replicas when the file declares none.

    Raises:
        FleetConfigError: unknown keys, wrong types or an impossible replica.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise FleetConfigError(f"{path}: {exc}") from exc
    try:
        parsed = _FleetFile.model_validate(raw)
    except ValidationError as exc:
        raise _config_error(exc) from exc
    replicas = tuple(parsed.replica)
    if replicas and engines is not None:
        raise FleetConfigError("--engines applies only when the fleet file declares no replicas")
    if not replicas:
        replicas = tuple(ReplicaConfig() for _ in range(engines or 2))
    fleet = parsed.fleet.model_dump(exclude_unset=True)
    if data_dir is not None:
        fleet["data_dir"] = Path(data_dir)
    try:
        return FleetConfig(router=parsed.router, replicas=replicas, **fleet)
    except ValidationError as exc:
        raise _config_error(exc) from exc
