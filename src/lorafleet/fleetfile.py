"""``<data-dir>/fleet.json``: how ``lorafleet status`` and ``publish --fleet`` find a fleet.

Written by ``lorafleet up`` (and the demo) with mode 0600, since it holds the control token and the
inference key. Format (``format`` is bumped on incompatible changes)::

    {
      "format": 1, "pid": 4242, "started_at": 1700000000.0, "data_dir": "/abs/.lorafleet",
      "router_url": "http://127.0.0.1:PORT", "router_pid": 4250,
      "dataplane_url": "http://127.0.0.1:PORT" | null,   # data-plane copies, if any
      "control_token": "...", "api_key": "..." | null,
      "model": "/abs/model", "served_model_name": "tiny",
      "replicas": [{"engine": "reference", "engine_url": "...", "engine_pid": 4243 | null,
                    "agent_url": "...", "agent_pid": 4245}]
    }

Torch-free: the publisher CLI imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lorafleet._atomic import atomic_write

__all__ = [
    "FLEET_FILE",
    "FORMAT",
    "FleetInfo",
    "FleetNotFound",
    "ReplicaInfo",
    "RunningFleet",
    "pid_alive",
    "read_fleet_file",
    "remove_fleet_file",
    "write_fleet_file",
]

FLEET_FILE = "fleet.json"
FORMAT = 1


class FleetNotFound(FileNotFoundError):
    """No readable fleet.json in the data directory."""


@dataclass(frozen=True)
class ReplicaInfo:
    engine: str
    engine_url: str
    agent_url: str
    agent_pid: int | None = None
    engine_pid: int | None = None
    """None when lorafleet did not start the engine (vLLM/SGLang given by URL)."""


class RunningFleet(Protocol):
    """What every running fleet (``LocalFleet``, ``RayFleet``) tells its ``fleet.json``."""

    @property
    def router_url(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def model(self) -> object: ...
    @property
    def served_model_name(self) -> str: ...
    @property
    def started_at(self) -> float | None: ...


@dataclass(frozen=True)
class FleetInfo:
    data_dir: str
    router_url: str
    control_token: str
    api_key: str | None
    model: str
    served_model_name: str
    replicas: list[ReplicaInfo] = field(default_factory=list)
    pid: int | None = None
    router_pid: int | None = None
    started_at: float | None = None
    dataplane_url: str | None = None
    """Where clients send generation when the fleet runs data-plane copies (None: the router)."""
    format: int = FORMAT

    @classmethod
    def of(
        cls,
        fleet: RunningFleet,
        replicas: Iterable[ReplicaInfo],
        *,
        data_dir: str,
        pid: int | None,
        router_pid: int | None,
    ) -> FleetInfo:
        """What ``fleet.json`` records of ``fleet``; ``replicas``, ``pid`` and ``router_pid`` are
        what only the fleet knows how to find (a process table, Ray's actors)."""
        return cls(
            data_dir=data_dir,
            router_url=fleet.router_url,
            control_token=fleet.token,
            api_key=fleet.api_key,
            model=str(fleet.model),
            served_model_name=fleet.served_model_name,
            replicas=list(replicas),
            pid=pid,
            router_pid=router_pid,
            started_at=fleet.started_at,
            dataplane_url=getattr(fleet, "dataplane_url", None),
        )

    @property
    def agent_urls(self) -> list[str]:
        return [r.agent_url for r in self.replicas]

    @property
    def inference_url(self) -> str:
        """Where clients send generation: the data-plane copies, else the router."""
        return self.dataplane_url or self.router_url

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FleetInfo:
        if raw.get("format") != FORMAT:
            raise ValueError(f"unsupported fleet file format {raw.get('format')!r}")
        raw = dict(raw)
        raw["replicas"] = [ReplicaInfo(**r) for r in raw.get("replicas", [])]
        return cls(**raw)


def pid_alive(pid: int | None) -> bool:
    """Whether a process with ``pid`` exists (signal 0 probes without touching it)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def write_fleet_file(info: FleetInfo, data_dir: str | os.PathLike) -> Path:
    """Write ``fleet.json`` atomically, created 0600 (it holds secrets) before any byte lands."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / FLEET_FILE
    atomic_write(path, (json.dumps(info.to_json(), indent=2) + "\n").encode(), mode=0o600)
    return path


def read_fleet_file(data_dir: str | os.PathLike) -> FleetInfo:
    """Read ``<data_dir>/fleet.json``.

    Raises:
        FleetNotFound: no fleet file there (no fleet was started with this data directory).
        ValueError: the file is not a fleet file of a supported format.
    """
    path = Path(data_dir) / FLEET_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FleetNotFound(f"no fleet at {path} (start one with `lorafleet up`)") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return FleetInfo.from_json(raw)


def remove_fleet_file(data_dir: str | os.PathLike, *, owner_pid: int | None = None) -> None:
    """Remove ``fleet.json`` (only if it still names ``owner_pid``, when given)."""
    path = Path(data_dir) / FLEET_FILE
    if owner_pid is not None:
        try:
            if json.loads(path.read_text()).get("pid") != owner_pid:
                return
        except (OSError, ValueError):
            return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
