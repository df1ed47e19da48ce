"""What one publication installs, fixed before its first byte moves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lorafleet.bundle import AdapterBundle
from lorafleet.protocol.agent import LoadMode, engine_name
from lorafleet.protocol.canary import Canary
from lorafleet.protocol.relay import RelayMeasure, RelayRates
from lorafleet.protocol.router import SessionPolicy

__all__ = ["Mode", "Plan", "ProgressCallback", "Transfer"]

Mode = Literal["atomic", "in_place"]
Transfer = str
"""``remote_upload``, ``relay``, ``shared_filesystem``, or the name of a carrier given to the
Publisher (``lorafleet.publisher.carrier``)."""
ProgressCallback = Callable[[str, int, int], None]
"""``on_progress(replica_id, bytes_sent_so_far, bytes_to_send)``."""


@dataclass(frozen=True)
class Plan:
    """One publication's immutable inputs: the bundle (name and version set), how it moves, and
    the version that was active when it began (the alias flip's compare-and-set)."""

    bundle: AdapterBundle
    mode: Mode
    transfer: Transfer
    previous: int | None
    shared_dir: Path | None = None
    supersede: bool = False
    """The name's lease is held: an agent may retire a failed publication's leftovers first."""
    verify: bool = True
    """Check on every replica that the engine applies v before the cutover."""
    keep_versions: int = 1
    """The retention window: v and the newest ``keep_versions - 1`` before it stay routable."""
    max_staleness: int | None = None
    sessions: SessionPolicy = "pin"
    previous_window: tuple[int, ...] = ()
    """The versions routable when the publication began, newest first."""
    relay_fanout: int | None = None
    """Relay: how many agents each agent forwards a file to (1: a chain); None: planned for each
    file from the number of replicas that lack it and ``relay_rates`` (``protocol/relay.py``)."""
    relay_rates: RelayRates = field(default_factory=RelayRates)
    """Relay: the link, receive and per-hop figures a planned tree is chosen by."""
    relay_stall_s: float = 10.0
    """Relay: a hop that moves no byte for this long is dropped and resumed by the Publisher."""
    on_relay_measure: Callable[[RelayMeasure], None] | None = None
    """Relay: told what each file's tree took (the Publisher learns its rates from it)."""
    canary: Canary | None = None
    """The trainer's canary, judged on every replica at the proof (``protocol/canary.py``)."""
    quorum: int | None = None
    """How many replicas must take v (verified, loaded, proven) for it to succeed; None: all
    of them (the atomic default). Below it the publication rolls back as with None."""
    placement: list[str] | None = None
    """The name's placement set (``publish(max_replicas=...)``), recorded with the flip; None:
    every replica."""

    @property
    def name(self) -> str:
        return self.bundle.name

    @property
    def version(self) -> int:
        return self.bundle.version

    @property
    def load_mode(self) -> LoadMode:
        return "versioned" if self.mode == "atomic" else "in_place"

    @property
    def engine_name(self) -> str:
        """The name engines register: immutable ``name@vN`` (atomic) or the plain name."""
        return engine_name(self.name, self.version, self.load_mode)

    @property
    def shared_path(self) -> Path | None:
        """Where a ``shared_filesystem`` publication hands the files over, else None."""
        if self.transfer != "shared_filesystem" or self.shared_dir is None:
            return None
        return self.shared_dir / self.name / f"v{self.version}"
