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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DEFAULT_DATA_DIR",
    "EngineKind",
    "FleetConfig",
    "FleetConfigError",
    "ReplicaConfig",
    "RouterConfig",
    "load_fleet_config",
]

DEFAULT_DATA_DIR = ".lorafleet"
EngineKind = Literal["reference", "vllm", "sglang"]
_ENGINES = ("reference", "vllm", "sglang")


class FleetConfigError(ValueError):
    """The fleet file is malformed (the message names the key)."""


@dataclass(frozen=True)
class ReplicaConfig:
    engine: EngineKind = "reference"
    url: str | None = None
    """An existing engine to put an agent in front of; required for vllm and sglang."""
    agent_port: int = 0
    engine_port: int = 0
    """Port of the reference engine lorafleet starts (0: a free one)."""
    max_loras: int = 8
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.engine not in _ENGINES:
            raise FleetConfigError(f"replica.engine must be one of {_ENGINES}, not {self.engine!r}")
        if self.engine != "reference" and not self.url:
            raise FleetConfigError(f"a {self.engine} replica needs url = 'http://host:port'")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise FleetConfigError(f"replica.url must be an http(s) URL, not {self.url!r}")

    @property
    def managed_engine(self) -> bool:
        """True when lorafleet starts (and restarts) this replica's engine itself."""
        return self.engine == "reference" and self.url is None


@dataclass(frozen=True)
class RouterConfig:
    port: int = 0


@dataclass(frozen=True)
class FleetConfig:
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    host: str = "127.0.0.1"
    model: Path | None = None
    """Base model of the reference engines; None means the tiny model (generated once, cached)."""
    served_model_name: str = "tiny"
    control_token: str | None = None
    api_key: str | None = None
    """None: generate one; "": no inference key."""
    router: RouterConfig = field(default_factory=RouterConfig)
    replicas: tuple[ReplicaConfig, ...] = ()

    @classmethod
    def default(cls, engines: int = 2, **overrides: Any) -> FleetConfig:
        """The embedded default: ``engines`` reference engines on the tiny model."""
        if engines < 1:
            raise FleetConfigError("a fleet needs at least one engine")
        return cls(replicas=tuple(ReplicaConfig() for _ in range(engines)), **overrides)


def _section(raw: Any, cls: type, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise FleetConfigError(f"[{where}] must be a table")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise FleetConfigError(f"unknown key(s) in [{where}]: {', '.join(unknown)}")
    return dict(raw)


_FLEET_KEYS = ("data_dir", "host", "model", "served_model_name", "control_token", "api_key")


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
            import tomllib
        except ImportError as exc:  # Python 3.10
            raise FleetConfigError("reading a fleet file needs Python 3.11+ (tomllib)") from exc
        try:
            raw = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise FleetConfigError(f"{path}: {exc}") from exc
    unknown = sorted(set(raw) - {"fleet", "router", "replica"})
    if unknown:
        raise FleetConfigError(f"unknown table(s): {', '.join(unknown)}")
    fleet = raw.get("fleet", {})
    if not isinstance(fleet, dict):
        raise FleetConfigError("[fleet] must be a table")
    bad = sorted(set(fleet) - set(_FLEET_KEYS))
    if bad:
        raise FleetConfigError(f"unknown key(s) in [fleet]: {', '.join(bad)}")
    router = RouterConfig(**_section(raw.get("router", {}), RouterConfig, "router"))
    replica_tables = raw.get("replica", [])
    if not isinstance(replica_tables, list):
        raise FleetConfigError("replica must be an array of tables: [[replica]]")
    try:
        replicas = tuple(
            ReplicaConfig(**_section(t, ReplicaConfig, "replica")) for t in replica_tables
        )
    except TypeError as exc:
        raise FleetConfigError(str(exc)) from exc
    if replicas and engines is not None:
        raise FleetConfigError("--engines applies only when the fleet file declares no replicas")
    if not replicas:
        replicas = tuple(ReplicaConfig() for _ in range(engines or 2))
    kwargs: dict[str, Any] = {k: fleet[k] for k in _FLEET_KEYS if k in fleet}
    for key in ("data_dir", "model"):
        if key in kwargs:
            kwargs[key] = Path(kwargs[key]).expanduser()
    if data_dir is not None:
        kwargs["data_dir"] = Path(data_dir)
    for key in ("host", "served_model_name", "control_token", "api_key"):
        if key in kwargs and not isinstance(kwargs[key], str):
            raise FleetConfigError(f"[fleet] {key} must be a string")
    return FleetConfig(router=router, replicas=replicas, **kwargs)
