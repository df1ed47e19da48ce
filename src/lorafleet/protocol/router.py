"""The router's wire protocol: version tags on the data plane, and the control plane.

Data plane (OpenAI-compatible; the inference key, if set, is a Bearer token)::

    POST /v1/completions, POST /v1/chat/completions   stream or not
    GET  /v1/models
    POST /generate                                   native token-id generation

Every routed response carries ``X-Lorafleet-Adapter`` / ``X-Lorafleet-Adapter-Version`` headers
and a ``lorafleet`` field (``VersionTag``) in the JSON body, or in one extra chunk with empty
``choices`` just before ``data: [DONE]`` in a stream.

Addressing (``model``): ``policy`` is the newest version, or the version a session (the
``X-Session-ID`` header) started on; ``policy@v7`` is exactly v7 while it is in the name's
retention window. Outside the window: 404 ``version_not_routable``, whose message lists the
routable versions; older than the newest by more than ``max_staleness``: 409 ``stale_version``.

Control plane (the control token, separate from the inference key)::

    GET    /v1/control/aliases                 -> AliasTable
    PUT    /v1/control/aliases/{name}          SetAliasRequest -> AliasEntry  (atomic flip; 409
                                               unknown_replica if a replica id is not known)
    DELETE /v1/control/aliases/{name}          -> 204
    POST   /v1/control/aliases/{name}/drain    DrainRequest -> DrainResponse
    POST   /v1/control/leases/{name}           LeaseRequest -> Lease (409 if another holder)
    DELETE /v1/control/leases/{name}/{holder}  -> 204 (the holder releases its lease)
    DELETE /v1/control/leases/{name}           -> 204 (an operator breaks whatever lease is held)
    GET    /v1/control/replicas                -> ReplicaList
    PUT    /v1/control/replicas/{replica_id}   MoveReplicaRequest -> ReplicaStatus (the replica
                                               was re-placed: it answers at a new agent URL)
    POST   /v1/control/replicas                AddReplicaRequest -> 201 ReplicaStatus (a new
                                               member: polled, then fed by catch-up)
    DELETE /v1/control/replicas/{replica_id}?drain_s=  -> ReplicaStatus (off every version
                                               first, drained, then forgotten)
    POST   /v1/control/aliases/{name}/reserve  ReserveRequest -> Reservation (the next version
                                               number, never handed out twice; with the lease
                                               and the alias: a publication's first call)
    DELETE /v1/control/aliases/{name}/reserve/{version}?holder=  -> 204 (give back a number
                                               whose attempt reached no engine)
    POST   /v1/control/aliases/{name}/warm     WarmRequest -> WarmResult (place a cold version:
                                               load it on a replica, making room there)
    POST   /v1/control/replicas/{replica_id}/room  RoomRequest -> RoomResult (evict the least
                                               recently used versions, drained, to free slots)

Data-plane copies (``docs/router.md``; the control token)::

    POST   /v1/control/sync?wait=              CopyReport -> Snapshot (a long poll: answered at
                                               once when the table changed since the copy's
                                               ``acked`` seq, else after ``wait`` seconds; the
                                               next report acknowledges what it applied)
    POST   /v1/control/pins                    PinRequest -> PinRecord (a session's pin while a
                                               flip of its name is under way)
    GET    /v1/control/copies                  -> CopyList

Quorum (``docs/quorum.md``): a version's ``replicas`` are exactly the replicas that hold it
verified, loaded and proven, each with the version's ``digest``; ``AliasEntry.lagging`` names the
others (since which version, why, when a publication tries them again). The router's catch-up
loop feeds a lagging or empty replica from a peer that holds the version and only then lists it.

Names, engine names, lease holders and versions follow ``lorafleet.protocol.names``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lorafleet.protocol.agent import check_local_path
from lorafleet.protocol.canary import CanaryVerdict
from lorafleet.protocol.names import AdapterName, EngineName, LeaseHolder, Version
from lorafleet.protocol.relay import RelayRates

__all__ = [
    "ADAPTER_HEADER",
    "MAX_REPLICAS",
    "MAX_REPLICA_ID",
    "REPLICA_HEADER",
    "SESSION_HEADER",
    "TAG_FIELD",
    "VERSION_HEADER",
    "AddReplicaRequest",
    "AliasEntry",
    "AliasEvent",
    "AliasTable",
    "CatchUpList",
    "CatchUpTree",
    "CopyList",
    "CopyReport",
    "CopyStatus",
    "DrainCount",
    "DrainRequest",
    "DrainResponse",
    "LagState",
    "Lease",
    "LeaseRequest",
    "MoveReplicaRequest",
    "PinRecord",
    "PinRequest",
    "RegisterRequest",
    "RegisterResult",
    "ReplicaDrain",
    "ReplicaList",
    "ReplicaStatus",
    "Reservation",
    "ReserveRequest",
    "RoomRequest",
    "RoomResult",
    "RoutableVersion",
    "RouterHealth",
    "SessionPolicy",
    "SetAliasRequest",
    "Snapshot",
    "VersionTag",
    "WarmRequest",
    "WarmResult",
]

ADAPTER_HEADER = "X-Lorafleet-Adapter"
VERSION_HEADER = "X-Lorafleet-Adapter-Version"
REPLICA_HEADER = "X-Lorafleet-Replica"
SESSION_HEADER = "X-Session-ID"
TAG_FIELD = "lorafleet"
MAX_REPLICAS = 4096
MAX_REPLICA_ID = 256


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VersionTag(_Model):
    adapter: str | None
    """None for base-model requests."""
    version: int | None
    replica: str
    engine_model: str | None = None
    """The model name the engine reported (e.g. ``policy@v3``), when the router saw one."""


SessionPolicy = Literal["pin", "follow"]


class RoutableVersion(_Model):
    version: int
    engine_name: str
    replicas: list[str]
    """The replicas that hold this version verified, loaded and proven (and only those)."""
    digest: str | None = None
    """The bundle digest every listed replica verified (None: an entry from before digests)."""
    canary: dict[str, CanaryVerdict] = Field(default_factory=dict)
    """How each listed replica's engine answered the trainer's canary when it took this version
    (by a publication or a catch-up); absent for a replica judged without one."""
    size: int | None = None
    """The bundle's bytes (its files' sizes summed; None: an entry from before sizes). What a
    tenant's byte quota counts."""


class LagState(_Model):
    """Why a replica does not hold a name's newest version, and when it is tried again."""

    since_version: int = Field(ge=1)
    """The first version it missed."""
    reason: str = Field(max_length=2048)
    failures: int = Field(default=1, ge=1)
    """Consecutive failed attempts (publications or catch-ups)."""
    retry_at: float = 0.0
    """Wall-clock seconds: a quorum publication skips this replica until then."""


class SetAliasRequest(_Model):
    version: Version
    engine_name: EngineName
    replicas: list[str] = Field(min_length=1, max_length=MAX_REPLICAS)
    """Replica ids (``AgentInfo.replica_id``) that hold this version, loaded and verified; each
    must be one the router knows from its agents (409 ``unknown_replica`` otherwise)."""
    expected_version: Version | None = None
    """Compare-and-set: refuse (409) unless the active version is this one (None: no alias yet)."""
    lease_holder: LeaseHolder | None = None
    keep_versions: int = Field(default=1, ge=1, le=64)
    """The retention window: this version and the newest ``keep_versions - 1`` before it stay
    routable (``name@vN``, and sessions that started on them)."""
    max_staleness: int | None = Field(default=None, ge=0)
    """Refuse a pin or a session more than this many versions behind the newest (None:
    ``keep_versions - 1``, i.e. the whole window)."""
    sessions: SessionPolicy = "pin"
    """``pin``: a session keeps the version it started on; ``follow``: always the newest. With
    ``keep_versions=1`` there is nothing to keep a session on: it follows (the pre-window
    behaviour), so a default publication never breaks a running session."""
    digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """The bundle digest each of ``replicas`` verified for this version."""
    lagging: dict[str, LagState] = Field(default_factory=dict, max_length=MAX_REPLICAS)
    """A quorum publication: the replicas that did not take this version, and why."""
    canary: dict[str, CanaryVerdict] = Field(default_factory=dict, max_length=MAX_REPLICAS)
    """The canary's figures on each of ``replicas`` (kept in the table and its ``/metrics``);
    an entry for a replica not in ``replicas`` is dropped."""
    placement: list[str] | None = Field(default=None, max_length=MAX_REPLICAS)
    """The name's placement set (``Publisher.publish(max_replicas=...)``): the replicas it was
    published to, holding or lagging; catch-up feeds only these. None: every replica."""
    size: int | None = Field(default=None, ge=0)
    """The bundle's bytes (kept in the table: tenants' byte quotas count them)."""
    release_lease: bool = False
    """Give ``lease_holder``'s lease back in the flip's own durable write: what follows the flip
    (recording v active, draining and releasing older versions) needs no lease, and another
    publisher of the name need not wait for it."""


class AliasEntry(_Model):
    name: str
    version: int
    """The newest version: what ``model=<name>`` gets."""
    engine_name: str
    replicas: list[str]
    seq: int
    """Position in the alias log of the flip that made this entry active."""
    keep_versions: int = 1
    max_staleness: int | None = None
    sessions: SessionPolicy = "pin"
    routable: list[RoutableVersion] = Field(default_factory=list)
    """The retention window, newest first (the newest is ``version``)."""
    lagging: dict[str, LagState] = Field(default_factory=dict)
    """Replicas that do not hold ``version`` yet: routed none of it until caught up."""
    placement: list[str] | None = None
    """The replicas this name is placed on (``docs/placement.md``): catch-up feeds only these.
    None: every replica (a name never evicted anywhere). An eviction takes its replica out, an
    on-demand load puts one in."""

    def placed_on(self, replica_id: str) -> bool:
        return self.placement is None or replica_id in self.placement

    def window(self) -> list[RoutableVersion]:
        """The routable versions, newest first (an entry written before windows: the newest)."""
        return self.routable or [
            RoutableVersion(version=self.version, engine_name=self.engine_name,
                            replicas=self.replicas)
        ]  # fmt: skip

    @property
    def pins_sessions(self) -> bool:
        """Sessions keep their version: asked for, and a window to keep it in."""
        return self.sessions == "pin" and self.keep_versions > 1

    @property
    def staleness(self) -> int:
        return self.keep_versions - 1 if self.max_staleness is None else self.max_staleness


class AliasEvent(_Model):
    seq: int
    ts: float
    name: str
    version: int | None
    """None when the alias was removed."""
    engine_name: str | None


class AliasTable(_Model):
    aliases: dict[str, AliasEntry]
    log: list[AliasEvent]


class DrainRequest(_Model):
    version: Version
    timeout_s: float = Field(default=30.0, ge=0, le=3600)


class DrainResponse(_Model):
    name: str
    version: int
    inflight: int
    drained: bool


class LeaseRequest(_Model):
    holder: LeaseHolder
    ttl_s: float = Field(default=300.0, gt=0, le=86400)


class Lease(_Model):
    name: str
    holder: str
    expires_in_s: float


class ReplicaStatus(_Model):
    replica_id: str
    agent_url: str
    engine_url: str | None
    healthy: bool
    inflight: int
    detail: str | None = None


class ReplicaList(_Model):
    replicas: list[ReplicaStatus]


class MoveReplicaRequest(_Model):
    """``PUT /v1/control/replicas/{replica_id}``: the replica was re-placed (e.g. its node died
    and a scheduler started it elsewhere) and its agent now answers at ``agent_url``.

    The router polls the new URL from then on and takes the replica off every version it was
    listed for: a re-placed replica holds nothing the router knows of until a publication lists
    it again. The same URL again changes nothing (a retry is safe)."""

    agent_url: str = Field(min_length=1, max_length=2048)
    """``http(s)://host[:port]``, no path, query or user; not another replica's."""


class ReserveRequest(_Model):
    """Take the next version number of a name (under the holder's lease)."""

    holder: LeaseHolder
    version: Version | None = None
    """A number asked for; refused (409) unless above every number handed out before."""
    lease_ttl_s: float | None = Field(default=None, gt=0, le=86400)
    """Also take (or renew) the holder's lease for this long, in the same durable write: a
    publication's first call. None: the holder must hold the lease already, or nobody."""


class Reservation(_Model):
    name: str
    version: int
    entry: AliasEntry | None = None
    """The name's alias when the number was handed out (None: never published): the active
    version a publication compares and sets against, its window and its lagging replicas."""
    replicas: list[ReplicaStatus] | None = None
    """With ``lease_ttl_s``: the router's view of the replicas (``GET /v1/control/replicas``)."""


class AddReplicaRequest(_Model):
    """``POST /v1/control/replicas``: a replica joins the fleet. The router polls its agent;
    once it is healthy, catch-up feeds it every routable version from peers, and only then is
    it routed any of them."""

    agent_url: str = Field(min_length=1, max_length=2048)
    """``http(s)://host[:port]``, no path, query or user; not another replica's."""


class RouterHealth(_Model):
    """``GET /health``: the router answers; how many replicas it knows and routes to."""

    status: Literal["ok"]
    replicas: int
    healthy: int


# --- data-plane copies ------------------------------------------------------------------------


class PinRecord(_Model):
    """Session ``session`` started on ``version`` of ``name`` (its pin holds on every copy);
    ``name`` None: the session ended (idle, or finished), everywhere."""

    session: str = Field(max_length=4096)
    name: str | None = None
    version: int | None = None


class DrainCount(_Model):
    """Requests a copy has in flight for one version that is being drained."""

    name: str
    version: int
    inflight: int = Field(ge=0)


class RoomRequest(_Model):
    """Make room for ``need`` more adapters on a replica whose engine is full, by evicting the
    least recently used versions of names other than ``keep`` (drained first)."""

    need: int = Field(default=1, ge=1, le=64)
    keep: list[str] = Field(default_factory=list, max_length=64)


class RoomResult(_Model):
    replica_id: str
    free: int
    """Free slots on the replica now (at least ``need`` when the call succeeded)."""
    evicted: list[str] = Field(default_factory=list)
    """The engine names evicted for it (``name@vN``)."""


class CatchUpTree(_Model):
    """One relay tree catch-up is feeding now: replicas that lack a version, fed from one peer."""

    name: str
    version: int
    source: str
    """The peer replica the tree is fed from."""
    fed: int
    """Replicas of the tree holding the version (staged and loaded) so far."""
    replicas: int


class CatchUpList(_Model):
    trees: list[CatchUpTree]
    relay_rates: RelayRates | None = None
    """What catch-up plans its next tree with: its defaults, refined by each tree that landed
    whole (``RelayRates.learned``); None without catch-up."""
    learned_from: int = 0
    """How many trees' measurements the rates were refined by."""


class RegisterRequest(_Model):
    """Register a PEFT directory by reference (``router/sources.py``): read once by the router
    for its manifest, copied and verified by an agent only where it is placed."""

    name: AdapterName
    path: str = Field(min_length=1, max_length=4095)
    """A directory under the router's ``--source-allow`` or ``--watch-dir`` roots, readable by
    the agents under their ``--shared-fs-allow``."""
    keep_versions: int = Field(default=2, ge=1, le=64)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return check_local_path(v)


class RegisterResult(_Model):
    name: str
    version: int
    """The version the directory's bytes are (a new one, or the newest when they are the same)."""
    digest: str
    size: int
    created: bool = True
    """False: the name's newest version already had these bytes; nothing changed."""


class WarmRequest(_Model):
    version: Version | None = None
    """The version to place (None: the newest)."""
    more: bool = False
    """Place it on one more replica than holds it now (its queue grew), not only if cold."""


class WarmResult(_Model):
    name: str
    version: int
    replicas: list[str]
    """The replicas that hold it now."""
    loaded: str | None = None
    """The replica it was loaded on by this call (None: it was placed already)."""


class ReplicaDrain(_Model):
    """Requests a copy has in flight on one replica that is leaving the fleet."""

    agent_url: str = Field(max_length=2048)
    inflight: int = Field(ge=0)
    name: str | None = Field(default=None, max_length=256)
    version: int | None = Field(default=None, ge=1)
    """Set: only the requests for this version on the replica (an eviction drains it)."""


class CopyReport(_Model):
    """What a data-plane copy tells the control plane in each sync (its long poll)."""

    copy_id: str = Field(min_length=1, max_length=256)
    epoch: str | None = None
    """The control plane's epoch of the snapshot ``acked`` belongs to (None: none yet)."""
    acked: int = Field(default=0, ge=0)
    """The table seq this copy applied and routes by: the acknowledgement of that flip."""
    pin_cursor: int = Field(default=0, ge=0)
    """The position in the control plane's pin log this copy has adopted up to."""
    pins: list[PinRecord] = Field(default_factory=list, max_length=100_000)
    """Pins made (or used again) and sessions finished here since the last report."""
    draining: list[DrainCount] = Field(default_factory=list, max_length=4096)
    """In-flight counts for the versions the last snapshot asked about."""
    leaving: list[ReplicaDrain] = Field(default_factory=list, max_length=4096)
    """In-flight counts on the replicas the last snapshot said are leaving."""
    url: str | None = Field(default=None, max_length=2048)
    """Where this copy serves (for ``lorafleet status``)."""
    pid: int | None = None
    inflight: int = Field(default=0, ge=0)
    healthy_replicas: int = Field(default=0, ge=0)
    requests: int = Field(default=0, ge=0)
    started_at: float = 0.0
    used: dict[str, float] = Field(default_factory=dict, max_length=100_000)
    """``name@vN`` -> seconds since this copy last routed a request for it (the control plane
    evicts the least recently used)."""


class Snapshot(_Model):
    """The control plane's answer to a sync: the routing table a copy serves by.

    ``aliases`` and ``agents`` are present when they changed since the copy's ``acked`` seq (or
    the epoch changed: a restarted control plane sends everything again), else None."""

    epoch: str
    seq: int
    aliases: dict[str, AliasEntry] | None = None
    agents: list[str] | None = None
    """Every replica's agent URL (membership): the copy polls their health itself."""
    flipping: list[str] = Field(default_factory=list)
    """Names whose flip is under way: a new session on one asks the control plane for its pin
    (``POST /v1/control/pins``) until the flip is in a snapshot."""
    draining: list[DrainCount] = Field(default_factory=list)
    """Versions being drained: report their in-flight counts (``inflight`` unused here)."""
    leaving: list[ReplicaDrain] = Field(default_factory=list)
    """Replicas leaving the fleet: report the requests in flight on each (``inflight`` unused)."""
    pins: list[PinRecord] = Field(default_factory=list)
    """Pins other copies made, from the copy's ``pin_cursor`` on."""
    pin_cursor: int = 0
    lease_s: float
    session_idle_s: float
    """Sessions end after this long unused anywhere (the control plane ends them)."""
    """The copy's table is current for this long after it sent the sync this answers."""


class PinRequest(_Model):
    session: str = Field(min_length=1, max_length=4096)
    name: str


class CopyStatus(_Model):
    copy_id: str
    url: str | None
    pid: int | None
    acked: int
    """The table seq it routes by (``seq``: the newest)."""
    current: bool
    """It acknowledged the newest table and synced within its lease."""
    fenced: bool
    """It missed a flip and stayed silent past its lease: it refuses adapter requests until it
    syncs again."""
    last_sync_s: float
    """Seconds since its last sync."""
    inflight: int
    healthy_replicas: int
    requests: int


class CopyList(_Model):
    epoch: str
    seq: int
    copies: list[CopyStatus]
