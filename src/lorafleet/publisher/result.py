"""What a publication returns: per-replica timings, bytes and the active version."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

from lorafleet.protocol.canary import CanaryVerdict
from lorafleet.protocol.relay import RelayMeasure

__all__ = [
    "STEPS",
    "Lagging",
    "PublishResult",
    "ReplicaState",
    "ReplicaTiming",
    "Retirement",
    "StepClock",
    "Timeouts",
]


STEPS = (
    "build",
    "name_lock",
    "begin",
    "down",
    "room",
    "stage",
    "cutover",
    "activate",
    "retire",
    "lease_release",
)
"""The steps of ``publish()`` in order: hash and validate the bundle; wait for an earlier
publication of the name in this Publisher (or its retirement in the background); ``begin``, in
one round trip's time: learn the agents and see them answer, the router's lease with the version
number and the active version (one call), the router's view of the replicas, the agents'
adapter lists; check the replicas the router sees down; check room on the engines; stage, load
and probe on every replica; the alias flip (which gives the lease back in the same write); record
v active on the agents; drain and release the versions that left the window; stop renewing the
lease (a call only if the flip did not give it back). With ``retire_in_background`` (the
default) the last three run after ``publish()`` returns (``Retirement``)."""


class StepClock:
    """Times the steps of one call back to back, keyed by name (a repeated step adds up)."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the body as ``name``, also when it raises."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.steps[name] = self.steps.get(name, 0.0) + time.perf_counter() - t


class ReplicaState(StrEnum):
    """Where one replica stands in a publication."""

    PENDING = "pending"
    STAGED = "staged"
    LOADED = "loaded"
    ACTIVE = "active"
    FAILED = "failed"
    LAGGING = "lagging"
    """A quorum publication went on without it; the router feeds it from a peer later."""
    ROLLED_BACK = "rolled_back"
    ROLLBACK_PENDING = "rollback_pending"
    """The rollback could not finish here (engine or agent down); ``rollback`` says what stays."""


@dataclass
class ReplicaTiming:
    """One replica's share of a publication. Seconds, wall clock."""

    replica: str
    agent_url: str
    state: ReplicaState = ReplicaState.PENDING
    upload_s: float = 0.0
    verify_s: float = 0.0
    """Commit on the agent: hard-link assembly and validation (streamed bytes are hashed inline)."""
    open_s: float = 0.0
    """Opening the upload session (part of ``upload_s``): the agent says what it lacks."""
    load_s: float = 0.0
    probe_s: float = 0.0
    """The application probe after the load (see ``application``)."""
    application: str = "unchecked"
    """Whether the engine was seen to apply the version before the cutover: ``applied``,
    ``unverifiable`` (its delta is zero or too small to show), ``not_applied``, ``unchecked``."""
    canary: CanaryVerdict | None = None
    """How the engine answered the trainer's canary (figures against trainer and base)."""
    bytes_sent: int = 0
    """Bytes that left the Publisher for this replica (its share of the trainer's egress)."""
    bytes_relayed: int = 0
    """Relay: bytes this replica received from another agent and verified."""
    files_sent: int = 0
    files_deduplicated: int = 0
    error: str | None = None
    rollback: str | None = None
    """After a failed publication: what the rollback did here, and what (if anything) stays."""


@dataclass
class Lagging:
    """A replica that does not hold the published version (a quorum publication)."""

    replica: str
    since_version: int
    """The first version of the name it missed."""
    reason: str
    retry_at: float
    """Wall-clock seconds: later quorum publications skip it until then (it may catch up from a
    peer before)."""


@dataclass
class PublishResult:
    """The outcome of a successful ``Publisher.publish``."""

    name: str
    version: int
    mode: str
    transfer: str
    engine_name: str
    digest: str
    duration_s: float
    build_s: float
    """Serializing and hashing the bundle (once, at the sender)."""
    cutover_s: float
    """The router's alias flip (atomic) or nothing (in place without a router)."""
    serving_s: float
    """From the call to the moment every new request resolves to this version."""
    retire_s: float
    """Recording v as active, draining v-1 and releasing older versions (after serving); 0 when
    that runs in the background (``Retirement``)."""
    bytes_sent: int
    """Bytes that left the Publisher in all (the trainer's egress)."""
    active_version: int
    replicas: dict[str, ReplicaTiming] = field(default_factory=dict)
    retired_versions: list[int] = field(default_factory=list)
    """The versions this call released (empty with ``retire_in_background``: ``Retirement``)."""
    routable_versions: list[int] = field(default_factory=list)
    """The name's retention window after this publication, newest first (``name@vN``)."""
    relay_measured: list[RelayMeasure] = field(default_factory=list)
    """Relay: what each file's tree took (per-hop time, receive rate), for files whose tree
    landed whole; what the Publisher's ``relay_rates`` learn from."""
    warnings: list[str] = field(default_factory=list)
    lagging: dict[str, Lagging] = field(default_factory=dict)
    """Quorum: the replicas that did not take this version (by replica id), and why."""
    quorum: int | None = None
    """The replicas this publication needed (None: every one)."""
    steps: dict[str, float] = field(default_factory=dict)
    """Seconds per step of the call, in order, back to back (see ``STEPS``): they add up to
    ``duration_s`` but for the argument checks between them. ``stage`` is the replicas' phase
    as a whole (each replica's share is in ``replicas``)."""

    @property
    def critical_s(self) -> float:
        """The slowest replica's transfer + verification + engine load + probe: the part of a
        publication that moves or checks bytes. The rest of ``duration_s`` is overhead."""
        return max(
            (r.upload_s + r.verify_s + r.load_s + r.probe_s for r in self.replicas.values()),
            default=0.0,
        )

    @property
    def overhead_s(self) -> float:
        """``duration_s`` minus ``critical_s``: what the Publisher and router add."""
        return self.duration_s - self.critical_s


@dataclass
class Retirement:
    """What a retirement run in the background did (``Publisher(retire_in_background=True)``,
    the default): v recorded active on every agent, the versions that left the window drained
    at the router and then released."""

    name: str
    version: int
    """The publication it followed."""
    retired_versions: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What it could not do (a version that stays loaded, an agent that did not answer)."""
    duration_s: float = 0.0
    error: str | None = None
    """It stopped short (an unexpected error, or it was cancelled): versions may stay loaded
    until a later publication releases them."""

    @property
    def ok(self) -> bool:
        """Everything it had to do was done."""
        return self.error is None and not self.warnings


@dataclass(frozen=True)
class Timeouts:
    """Per-phase limits in seconds."""

    connect: float = 5.0
    upload: float = 3600.0
    commit: float = 120.0
    load: float = 120.0
    cutover: float = 30.0
    drain: float = 60.0
    lease_ttl: float = 600.0
    answer: float = 5.0
    """An agent's first call in a publication (and the router's word on it): one that does not
    answer within this, or that the router sees down and whose engine is not ready, fails the
    publication at once (all replicas required) or is left lagging (a quorum)."""
    straggler: float = 30.0
    """Quorum: once the quorum holds v, how long the others may still take before they are left
    lagging (and rolled back where they answer)."""
