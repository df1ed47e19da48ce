"""The fleet's record: a small named actor that remembers where everything listens.

``attach(namespace)`` reads it, so nobody keeps URL lists. When a node dies and Ray re-places a
replica elsewhere, the replica's agent actor writes its new URLs here (``place_replica``) and a
restarted router actor reads the agents' current URLs from here. The record is kept in a file
as well, so a restarted record actor (``max_restarts=-1``) remembers moves made before it died.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray

from lorafleet._atomic import atomic_write

__all__ = ["RECORD", "FleetRecord", "find_record"]

RECORD = "lorafleet-fleet"
"""The record actor's name in the fleet's namespace."""


class FleetRecord:
    """A fleet as ``RayFleet.to_record`` writes it, kept current as replicas move.

    Args:
        record: the fleet at deployment.
        path: a file for the record on the actor's node (None: memory only). A saved record
            from the same deployment (same ``started_at``) wins over ``record``: it has the moves.
    """

    def __init__(self, record: dict[str, Any], path: str | None = None) -> None:
        self.path = Path(path) if path else None
        self.record = record
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                saved = json.loads(self.path.read_text())
            except (OSError, ValueError):
                saved = None
            if isinstance(saved, dict) and saved.get("started_at") == record.get("started_at"):
                self.record = saved
            self._save()

    def _save(self) -> None:
        if self.path is not None:
            atomic_write(self.path, json.dumps(self.record).encode())

    def get(self) -> dict[str, Any]:
        return self.record

    def place_replica(
        self, index: int, *, agent_url: str, engine_url: str, node_id: str
    ) -> str | None:
        """Replica ``index`` now answers at these URLs. Returns the agent URL it had before,
        or None when nothing changed (a restart in place)."""
        r = self.record["replicas"][index]
        if (r["agent_url"], r["engine_url"]) == (agent_url, engine_url):
            return None
        was = r["agent_url"]
        r.update(agent_url=agent_url, engine_url=engine_url, node_id=node_id)
        self._save()
        return was

    def set_router_url(self, url: str) -> None:
        if self.record["router_url"] != url:
            self.record["router_url"] = url
            self._save()

    def forget(self) -> None:
        """The fleet is being shut down: remove the file (it holds the tokens)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def find_record(namespace: str) -> Any | None:
    """The record actor of the fleet in ``namespace``, or None when there is none."""
    try:
        return ray.get_actor(RECORD, namespace=namespace)
    except ValueError:
        return None
