"""The alias table: each adapter name's routable versions, its flip log, and leases.

A name's entry holds its retention window: the newest version (what ``model=<name>`` gets) and
up to ``keep_versions - 1`` older ones that stay routable for pins (``name@vN``) and sessions.
A flip adds a version at the front and drops what falls off the back; those versions are
drained by the router and then released by the Publisher.

Pure state plus two durable files. Every mutation builds the new state, writes it to disk and
only then swaps it in, so what a client was told is what survives a restart: a flip's event is
appended to the flip log (``router-log.jsonl``, one event a line, fdatasync) and then the rest
of the state, which is small, replaces ``router-state.json`` (temp file + fsync +
``os.replace``). So a write costs the same with 10,000 events in the log as with none. On
start, an event whose ``seq`` the state file does not reach (its flip was never made durable)
and a line cut short by a crash are dropped. Errors are ``lorafleet.errors`` classes with the
protocol's codes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorafleet._atomic import atomic_write
from lorafleet.errors import InvalidName, NotFound, PublishInProgress, VersionConflict
from lorafleet.protocol.canary import CanaryVerdict
from lorafleet.protocol.names import check_engine_name, check_holder, check_name
from lorafleet.protocol.router import (
    AliasEntry,
    AliasEvent,
    AliasTable,
    LagState,
    Lease,
    RoutableVersion,
    SessionPolicy,
)

__all__ = ["LOG_FILE", "STATE_FILE", "AliasStore", "LeaseRecord"]

STATE_FILE = "router-state.json"
LOG_FILE = "router-log.jsonl"
# The log is for audits and the consistency checker; cap it so the file stays small.
MAX_LOG = 10_000

_UNSET = object()

log = logging.getLogger("lorafleet.router")


def _event_json(event: AliasEvent) -> str:
    return json.dumps(event.model_dump(), separators=(",", ":"))


@dataclass
class LeaseRecord:
    holder: str
    expires_at: float
    """Wall-clock seconds, so a persisted lease means the same thing after a restart."""


class AliasStore:
    """Aliases, the flip log and leases, optionally persisted in ``state_dir``."""

    def __init__(
        self,
        state_dir: str | os.PathLike | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.on_change = on_change
        """Called after every change of ``aliases`` is durable (the data-plane copies' seq)."""
        self.aliases: dict[str, AliasEntry] = {}
        self.log: list[AliasEvent] = []
        self.seq = 0
        self.leases: dict[str, LeaseRecord] = {}
        self.reserved: dict[str, int] = {}
        """name -> the highest version number handed out (``reserve``); never handed out again
        unless given back by ``release_version``."""
        self._given: dict[str, int] = {}
        """name -> what ``reserved`` was before the last reservation (for ``release_version``)."""
        self._log_lines = 0
        """Lines in the log file: past twice ``MAX_LOG`` it is rewritten with the newest."""
        self.path = Path(state_dir) / STATE_FILE if state_dir else None
        self.log_path = Path(state_dir) / LOG_FILE if state_dir else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._load()

    # --- persistence ---------------------------------------------------------------------------

    def _load(self) -> None:
        assert self.path is not None
        raw = json.loads(self.path.read_text())
        self.aliases = {k: AliasEntry.model_validate(v) for k, v in raw["aliases"].items()}
        self.seq = int(raw["seq"])
        self._load_log(raw.get("log", []))
        self.leases = {k: LeaseRecord(**v) for k, v in raw.get("leases", {}).items()}
        self.reserved = {k: int(v) for k, v in raw.get("reserved", {}).items()}
        self._given = {k: int(v) for k, v in raw.get("given", {}).items()}
        # A file an older router wrote may hold what the name rule now refuses (a name with a
        # newline, an empty engine name or lease holder): it could never be served or released.
        for name, entry in list(self.aliases.items()):
            try:
                check_name(name)
                check_engine_name(entry.engine_name)
            except InvalidName as exc:
                log.warning("dropping stored alias %r: %s", name, exc)
                del self.aliases[name]
        for name, lease in list(self.leases.items()):
            try:
                check_name(name)
                check_holder(lease.holder)
            except InvalidName as exc:
                log.warning("dropping stored lease on %r: %s", name, exc)
                del self.leases[name]

    def _load_log(self, inline: list[dict]) -> None:
        """The flip log: the events a state file of an older router holds, then the log file's,
        a later line for a ``seq`` replacing an earlier one (a flip whose state write failed
        left its line, and the next flip took its ``seq``); those the state reaches, newest
        ``MAX_LOG``. A file that held anything else (a line cut short, an event never made
        durable) is rewritten without it, so that the next append starts on a line of its own."""
        assert self.log_path is not None
        events: dict[int, AliasEvent] = {}
        for e in inline:
            event = AliasEvent.model_validate(e)
            events[event.seq] = event
        lines = 0
        clean = True
        if self.log_path.exists():
            data = self.log_path.read_bytes()
            clean = data.endswith(b"\n") or not data
            for line in data.splitlines():
                lines += 1
                try:
                    event = AliasEvent.model_validate_json(line)
                except ValueError:
                    clean = False
                    log.warning("dropping a line of %s that is cut short", self.log_path)
                    continue
                events[event.seq] = event
        kept = [events[k] for k in sorted(events) if k <= self.seq]
        self.log = kept[-MAX_LOG:]
        self._log_lines = lines
        if inline or not clean or len(kept) != lines or lines > MAX_LOG:
            self._write_log(self.log)

    def _write_log(self, events: list[AliasEvent]) -> None:
        assert self.log_path is not None
        atomic_write(self.log_path, "".join(_event_json(e) + "\n" for e in events).encode())
        self._log_lines = len(events)

    def _append_log(self, events: list[AliasEvent]) -> None:
        assert self.log_path is not None
        # 0600 like the state file (atomic_write's default): both hold the routing state.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "ab") as f:
            f.write("".join(_event_json(e) + "\n" for e in events).encode())
            f.flush()
            os.fdatasync(f.fileno())
        self._log_lines += len(events)

    def _persist(
        self,
        aliases: dict[str, AliasEntry],
        log: list[AliasEvent],
        seq: int,
        leases: dict[str, LeaseRecord],
    ) -> None:
        """Make the new state durable: the log's new events first, then the state file (whose
        ``seq`` is what commits them)."""
        if self.path is None:
            return
        fresh = seq - self.seq
        new = [e for e in log[-fresh:] if e.seq > self.seq] if fresh > 0 else []
        if new:
            if self._log_lines + len(new) > 2 * MAX_LOG:
                self._write_log(log)
            else:
                self._append_log(new)
        doc = {
            "aliases": {k: v.model_dump() for k, v in aliases.items()},
            "log": [],  # in LOG_FILE (a router before it read the log from here)
            "seq": seq,
            "leases": {
                k: {"holder": v.holder, "expires_at": v.expires_at} for k, v in leases.items()
            },
            "reserved": self.reserved,
            "given": self._given,
        }
        atomic_write(self.path, json.dumps(doc, separators=(",", ":")).encode())

    # --- reads ---------------------------------------------------------------------------------

    def table(self) -> AliasTable:
        return AliasTable(aliases=dict(self.aliases), log=list(self.log))

    def lease_of(self, name: str, now: float | None = None) -> LeaseRecord | None:
        """The unexpired lease on ``name``, if any."""
        lease = self.leases.get(name)
        if lease is None or lease.expires_at <= (time.time() if now is None else now):
            return None
        return lease

    def _check_lease(self, name: str, holder: str | None) -> None:
        lease = self.lease_of(name)
        if lease is not None and lease.holder != holder:
            raise PublishInProgress(
                f"{name!r} is leased by {lease.holder!r} "
                f"for another {lease.expires_at - time.time():.1f}s",
            )

    # --- mutations -----------------------------------------------------------------------------

    def _append(self, name: str, version: int | None, engine_name: str | None) -> AliasEvent:
        seq = self.seq + 1
        return AliasEvent(
            seq=seq, ts=time.time(), name=name, version=version, engine_name=engine_name
        )

    def set_alias(
        self,
        name: str,
        version: int,
        engine_name: str,
        replicas: list[str],
        *,
        expected_version: object = _UNSET,
        lease_holder: str | None = None,
        keep_versions: int = 1,
        max_staleness: int | None = None,
        sessions: SessionPolicy = "pin",
        digest: str | None = None,
        lagging: dict[str, LagState] | None = None,
        canary: dict[str, CanaryVerdict] | None = None,
        placement: list[str] | None = None,
        size: int | None = None,
        release_lease: bool = False,
    ) -> AliasEntry:
        """Flip ``name`` to ``version``. ``expected_version`` left unset skips compare-and-set.

        ``replicas`` hold it verified with ``digest``; ``lagging`` (a quorum publication) says
        why the others do not. A replica that was lagging before and is not among ``replicas``
        stays lagging, since the version it first missed.

        The new window is ``version`` plus the newest ``keep_versions - 1`` versions that were
        routable before (the versions that fall out are no longer routable for new requests).
        ``release_lease``: ``lease_holder``'s lease on ``name`` goes in the same write.

        Raises ``PublishInProgress`` (someone else holds the lease),
        ``VersionConflict`` (CAS failed, or ``version`` is not newer than the active one).
        """
        self._check_lease(name, lease_holder)
        current = self.aliases.get(name)
        active = current.version if current else None
        if expected_version is not _UNSET and expected_version != active:
            raise VersionConflict(
                f"{name!r}: expected active version {expected_version}, found {active}",
                param="expected_version",
            )
        if active is not None and version <= active:
            raise VersionConflict(
                f"{name!r}: version {version} is not newer than the active version {active}",
                param="version",
            )
        event = self._append(name, version, engine_name)
        newest = RoutableVersion(
            version=version,
            engine_name=engine_name,
            replicas=list(replicas),
            digest=digest,
            canary={r: c for r, c in (canary or {}).items() if r in replicas},
            size=size,
        )
        kept = current.window() if current else []
        lag = {r: st for r, st in (current.lagging if current else {}).items() if r not in replicas}
        for r, st in (lagging or {}).items():
            if r in replicas:
                continue
            before = lag.get(r)
            lag[r] = (
                st.model_copy(
                    update={"since_version": before.since_version, "failures": before.failures + 1}
                )
                if before is not None
                else st
            )
        entry = AliasEntry(
            name=name,
            version=version,
            engine_name=engine_name,
            replicas=list(replicas),
            seq=event.seq,
            keep_versions=keep_versions,
            max_staleness=max_staleness,
            sessions=sessions,
            routable=[newest, *kept][:keep_versions],
            lagging=lag,
            placement=None if placement is None else sorted({*placement, *replicas}),
        )
        aliases = {**self.aliases, name: entry}
        log = [*self.log, event][-MAX_LOG:]
        # A version flipped to is taken, whoever chose its number (persisted with the flip).
        self.reserved[name] = max(self.reserved.get(name, 0), version)
        self._given.pop(name, None)
        leases = self.leases
        if release_lease and lease_holder is not None and name in leases:
            leases = {k: v for k, v in leases.items() if k != name}
        self._persist(aliases, log, event.seq, leases)
        # Swap after the write: what the caller is told is what a restart will find. The write
        # and the swap run in one synchronous block, so no request is resolved between them and
        # ``event.ts`` is, to the event loop, the instant the flip happened.
        self.aliases, self.log, self.seq, self.leases = aliases, log, event.seq, leases
        self._changed()
        return entry

    def delete_alias(self, name: str, lease_holder: str | None = None) -> AliasEvent:
        """Remove ``name``. Raises ``NotFound`` / ``PublishInProgress``."""
        if name not in self.aliases:
            raise NotFound(f"no alias {name!r}")
        self._check_lease(name, lease_holder)
        event = self._append(name, None, None)
        aliases = {k: v for k, v in self.aliases.items() if k != name}
        log = [*self.log, event][-MAX_LOG:]
        self._persist(aliases, log, event.seq, self.leases)
        self.aliases, self.log, self.seq = aliases, log, event.seq
        self._changed()
        return event

    def forget_replica(self, replica_id: str, *, member: bool = True) -> list[str]:
        """Take ``replica_id`` off every routable version (it was re-placed and holds none of
        them now, or it leaves the fleet: ``member=False`` also drops its lagging state).
        Returns the names whose holders changed; a version left without a holder answers 503
        ``no_replica`` until a publication or a catch-up lists one again."""

        def without(ids: list[str]) -> list[str]:
            return [r for r in ids if r != replica_id]

        changed = {}
        for name, entry in self.aliases.items():
            window = entry.window()
            lagging = entry.lagging
            if not member and replica_id in lagging:
                lagging = {r: st for r, st in lagging.items() if r != replica_id}
            elif not any(replica_id in v.replicas for v in window):
                continue
            routable = [
                v.model_copy(
                    update={
                        "replicas": without(v.replicas),
                        "canary": {r: c for r, c in v.canary.items() if r != replica_id},
                    }
                )
                for v in window
            ]
            placement = entry.placement
            if not member and placement is not None:
                placement = without(placement)
            changed[name] = entry.model_copy(
                update={
                    "replicas": without(entry.replicas),
                    "routable": routable,
                    "lagging": lagging,
                    "placement": placement,
                }
            )
        if changed:
            aliases = {**self.aliases, **changed}
            self._persist(aliases, self.log, self.seq, self.leases)
            self.aliases = aliases
            self._changed()
        return sorted(changed)

    # --- quorum: holders, lagging replicas and version numbers ---------------------------------

    def _replace(self, name: str, entry: AliasEntry) -> AliasEntry:
        aliases = {**self.aliases, name: entry}
        self._persist(aliases, self.log, self.seq, self.leases)
        self.aliases = aliases
        self._changed()
        return entry

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def add_holder(
        self,
        name: str,
        version: int,
        digest: str,
        replica_id: str,
        canary: CanaryVerdict | None = None,
    ) -> bool:
        """``replica_id`` caught up: it holds ``version`` verified with ``digest`` (it was
        loaded and proven, with ``canary``'s figures when the version has a canary). False
        (nothing changes) when that version is no longer routable or its digest is another one:
        a claim for other bytes is never listed."""
        entry = self.aliases.get(name)
        if entry is None:
            return False
        window = entry.window()
        ref = next((v for v in window if v.version == version), None)
        if ref is None or (ref.digest is not None and ref.digest != digest):
            return False
        if replica_id in ref.replicas:
            return True
        judged = {**ref.canary, replica_id: canary} if canary is not None else ref.canary
        routable = [
            v.model_copy(update={"replicas": [*v.replicas, replica_id], "canary": judged})
            if v is ref
            else v
            for v in window
        ]
        update: dict = {"routable": routable}
        if version == entry.version:
            update["replicas"] = [*entry.replicas, replica_id]
            update["lagging"] = {r: s for r, s in entry.lagging.items() if r != replica_id}
        if entry.placement is not None and replica_id not in entry.placement:
            update["placement"] = [*entry.placement, replica_id]
        self._replace(name, entry.model_copy(update=update))
        return True

    @staticmethod
    def _without(
        entry: AliasEntry | None, version: int, replica_id: str
    ) -> list[RoutableVersion] | None:
        """``entry``'s window with ``replica_id`` off ``version`` (its canary figures too); None
        when it was not listed for it."""
        if entry is None:
            return None
        window = entry.window()
        if not any(v.version == version and replica_id in v.replicas for v in window):
            return None
        return [
            v.model_copy(
                update={
                    "replicas": [r for r in v.replicas if r != replica_id],
                    "canary": {r: c for r, c in v.canary.items() if r != replica_id},
                }
            )
            if v.version == version
            else v
            for v in window
        ]

    def evict_holder(self, name: str, version: int, replica_id: str, members: list[str]) -> bool:
        """``replica_id`` gives up ``version`` of ``name`` to make room: off its holders and its
        placement (``members``: every replica id, what a placement of None stood for), so that
        nothing routes it there and catch-up does not put it back. True if it was listed."""
        entry = self.aliases.get(name)
        routable = self._without(entry, version, replica_id)
        if entry is None or routable is None:
            return False
        placed = entry.placement if entry.placement is not None else members
        update: dict = {
            "routable": routable,
            "placement": [r for r in placed if r != replica_id],
            "lagging": {r: s for r, s in entry.lagging.items() if r != replica_id},
        }
        if version == entry.version:
            update["replicas"] = [r for r in entry.replicas if r != replica_id]
        self._replace(name, entry.model_copy(update=update))
        return True

    def drop_holder(self, name: str, version: int, replica_id: str, reason: str) -> bool:
        """``replica_id`` no longer holds ``version`` (its store was wiped, its engine lost it):
        off that version's replicas, lagging on the newest. True if it was listed."""
        entry = self.aliases.get(name)
        routable = self._without(entry, version, replica_id)
        if entry is None or routable is None:
            return False
        update: dict = {"routable": routable}
        if version == entry.version:
            update["replicas"] = [r for r in entry.replicas if r != replica_id]
            update["lagging"] = {
                **entry.lagging,
                replica_id: LagState(since_version=version, reason=reason, retry_at=0.0),
            }
        self._replace(name, entry.model_copy(update=update))
        return True

    def note_lag(self, name: str, replica_id: str, reason: str, retry_at: float) -> None:
        """A catch-up of ``replica_id`` failed: count it, say why, and when to try again."""
        entry = self.aliases.get(name)
        if entry is None or replica_id in entry.replicas:
            return
        before = entry.lagging.get(replica_id)
        st = LagState(
            since_version=before.since_version if before else entry.version,
            reason=reason[:2048],
            failures=(before.failures + 1) if before else 1,
            retry_at=retry_at,
        )
        self._replace(name, entry.model_copy(update={"lagging": {**entry.lagging, replica_id: st}}))

    def reserve(
        self,
        name: str,
        holder: str,
        version: int | None = None,
        *,
        lease_ttl_s: float | None = None,
    ) -> int:
        """Hand out the next version number of ``name`` to the lease ``holder``: above the
        active version and above every number handed out before (a failed attempt's number is
        burnt unless given back). ``lease_ttl_s``: grant or renew the holder's lease too, in
        the same write (both or neither). Raises ``PublishInProgress`` (another holder's lease)
        and ``VersionConflict`` (``version`` asked for is not above them)."""
        self._check_lease(name, holder)
        entry = self.aliases.get(name)
        if version is not None and entry is not None and version <= entry.version:
            raise VersionConflict(
                f"version {version} of {name!r} is not newer than the active version "
                f"{entry.version}",
                param="version",
            )
        floor = max(self.reserved.get(name, 0), entry.version if entry else 0)
        if version is None:
            version = floor + 1
        elif version <= floor:
            raise VersionConflict(
                f"{name!r}: version {version} is not above v{floor}, the newest number handed "
                "out (a number a failed attempt used is never reused)",
                param="version",
            )
        leases = self.leases
        if lease_ttl_s is not None:
            expires = time.time() + lease_ttl_s
            leases = {**leases, name: LeaseRecord(holder=holder, expires_at=expires)}
        self._given[name] = self.reserved.get(name, 0)
        self.reserved[name] = version
        self._persist(self.aliases, self.log, self.seq, leases)
        self.leases = leases
        return version

    def release_version(self, name: str, holder: str, version: int) -> bool:
        """Give ``version`` back: its attempt failed before any byte reached an engine, so the
        next publication may take it. Only the newest number handed out, only by the lease's
        holder, only if never flipped to. Idempotent; True if it was given back."""
        self._check_lease(name, holder)
        entry = self.aliases.get(name)
        if self.reserved.get(name) != version or (entry is not None and entry.version >= version):
            return False
        prev = self._given.pop(name, version - 1)
        self.reserved[name] = min(prev, version - 1)
        self._persist(self.aliases, self.log, self.seq, self.leases)
        return True

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Grant or renew; ``PublishInProgress`` if another holder has it."""
        self._check_lease(name, holder)
        leases = {**self.leases, name: LeaseRecord(holder=holder, expires_at=time.time() + ttl_s)}
        self._persist(self.aliases, self.log, self.seq, leases)
        self.leases = leases
        return Lease(name=name, holder=holder, expires_in_s=ttl_s)

    def break_lease(self, name: str) -> LeaseRecord | None:
        """Remove the lease on ``name`` whoever holds it (an operator's override); idempotent.

        Returns the lease that was broken, if one was held and unexpired.
        """
        lease = self.lease_of(name)
        if name not in self.leases:
            return None
        leases = {k: v for k, v in self.leases.items() if k != name}
        self._persist(self.aliases, self.log, self.seq, leases)
        self.leases = leases
        return lease

    def release_lease(self, name: str, holder: str) -> None:
        """Release ``holder``'s lease; idempotent. ``publish_in_progress`` if another holds it."""
        lease = self.lease_of(name)
        if lease is None:
            if name in self.leases:  # expired: forget it quietly
                self.leases = {k: v for k, v in self.leases.items() if k != name}
            return
        if lease.holder != holder:
            self._check_lease(name, holder)
        leases = {k: v for k, v in self.leases.items() if k != name}
        self._persist(self.aliases, self.log, self.seq, leases)
        self.leases = leases
