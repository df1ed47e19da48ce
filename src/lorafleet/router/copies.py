"""The control plane's side of its data-plane copies: versioned snapshots, acknowledgements,
fencing, pins and drain counts (the model is Envoy's xDS: docs/router.md).

Every change to the routing table (a flip, a holder added or dropped, membership) is a new
``seq`` of this control plane's ``epoch``. A copy syncs with a long poll (``sync``) that carries
its report: the seq it applied (its acknowledgement), the pins it made, its in-flight counts for
the versions being drained and the replicas leaving the fleet. It is answered at once when there
is something new for it, else after ``wait`` seconds with a heartbeat that renews its lease.

A flip waits (``wait_acked``) until every live copy has acknowledged it or is fenced. A copy's
table is current for ``lease_s`` after it *sent* the sync whose answer it holds, and a copy that
was frozen past its lease refuses adapter requests until it syncs again (``dataplane/sync.py``).
So a copy that stays silent for ``lease_s`` plus a margin after its last sync reached here is
known to be fenced: ``publish()`` then returns without it, and it never answers with the old
version as the newest. A copy silent for ``forget_s`` is dropped from the set (it died).

Pins: copies pin new sessions locally (no round trip) and report them; the first pin of a
session and name stands (``Sessions.merge``, on the authoritative sessions of the in-process
data plane) and goes out to every copy through the pin log. While a flip of a name that pins
sessions is under way (``flipping``), a copy asks here for a session it does not know (``pin``),
so a session that started on the old version on one copy keeps it on every other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lorafleet.dataplane.sessions import Pin, Sessions
from lorafleet.protocol.router import (
    AliasEntry,
    CopyList,
    CopyReport,
    CopyStatus,
    DrainCount,
    PinRecord,
    ReplicaDrain,
    Snapshot,
)

__all__ = ["Copies"]

log = logging.getLogger("lorafleet.router.copies")

_MAX_PINS_PER_ANSWER = 20_000
# The pin log keeps this many pins: a copy that fell further behind has missed only sessions old
# enough to have gone idle (a session's pin is reported again while it is in use).
_MAX_PIN_LOG = 1_000_000


@dataclass
class _Copy:
    copy_id: str
    report: CopyReport
    last_seen: float
    """Monotonic time its last sync arrived here."""
    acked: int = 0
    epoch: str | None = None
    draining: dict[tuple[str, int], int] = field(default_factory=dict)
    leaving: dict[tuple[str, tuple[str, int] | None], int] = field(default_factory=dict)


class Copies:
    """The data-plane copies of one control plane (see the module docstring)."""

    def __init__(
        self,
        table: Callable[[], dict[str, AliasEntry]],
        agents: Callable[[], list[str]],
        sessions: Sessions,
        *,
        lease_s: float = 2.0,
        margin_s: float = 0.5,
        forget_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._table = table
        self._agents = agents
        self.sessions = sessions
        self.lease_s = lease_s
        self.margin_s = margin_s
        self.forget_s = forget_s
        self._clock = clock
        self.epoch = secrets.token_hex(8)
        """A new control plane process is a new epoch: copies then take the whole table."""
        self.seq = 1
        self.flipping: set[str] = set()
        self.draining: set[tuple[str, int]] = set()
        self.leaving: set[tuple[str, tuple[str, int] | None]] = set()
        """(agent URL, None) of replicas leaving the fleet, and (agent URL, (name, version)) of
        versions being evicted from one: copies report their in-flight counts."""
        self.used: dict[tuple[str, int], float] = {}
        """(name, version) -> monotonic time a copy last reported routing it."""
        self.copies: dict[str, _Copy] = {}
        self._pins: list[Pin] = []
        self._pin_base = 0
        """The log position of ``_pins[0]`` minus one (what was trimmed off its head)."""
        self._changed = asyncio.Event()
        self._acked = asyncio.Event()

    # --- changes -------------------------------------------------------------------------------

    def bump(self) -> int:
        """The routing table changed: a new seq, and every waiting copy is answered."""
        self.seq += 1
        self._wake()
        return self.seq

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def pin_seq(self) -> int:
        """The log position of the newest pin."""
        return self._pin_base + len(self._pins)

    def log_pins(self, pins: list[Pin]) -> None:
        """Pins every copy must adopt (the first pins of sessions, or corrections)."""
        if not pins:
            return
        self._pins.extend(pins)
        if len(self._pins) > _MAX_PIN_LOG:
            cut = len(self._pins) // 2
            self._pins = self._pins[cut:]
            self._pin_base += cut
        self._wake()

    # --- copies' syncs -------------------------------------------------------------------------

    def report(self, r: CopyReport) -> _Copy:
        """Take a copy's report: its acknowledgement, its pins, its drain counts."""
        now = self._clock()
        c = self.copies.get(r.copy_id)
        if c is None:
            c = self.copies[r.copy_id] = _Copy(r.copy_id, r, now)
            log.info("data-plane copy %s joined (%s)", r.copy_id, r.url)
        c.report, c.last_seen = r, now
        c.epoch, c.acked = r.epoch, r.acked if r.epoch == self.epoch else 0
        c.draining = {(d.name, d.version): d.inflight for d in r.draining}
        c.leaving = {
            (d.agent_url, None if d.name is None or d.version is None else (d.name, d.version)): (
                d.inflight
            )
            for d in r.leaving
        }
        now = self._clock()
        for ename, ago in r.used.items():
            name, _, v = ename.rpartition("@v")
            if name and v.isdigit():
                key = (name, int(v))
                self.used[key] = max(self.used.get(key, 0.0), now - ago)
        if r.pins:
            self.log_pins(self.sessions.merge(Pin(p.session, p.name, p.version) for p in r.pins))
        # Sessions idle past their lifetime end everywhere; the in-process data plane's own
        # pins and ends go out to the copies too.
        self.sessions.sweep()
        self.log_pins(self.sessions.take_news())
        self._acked.set()
        self._acked = asyncio.Event()
        return c

    def snapshot(self, c: _Copy, cursor: int) -> Snapshot:
        """What copy ``c`` needs: the table if it has not acknowledged this seq, the pins past
        its cursor, what to report on."""
        full = c.epoch != self.epoch or c.acked < self.seq
        if cursor > self.pin_seq or c.epoch != self.epoch:
            cursor = 0  # a restarted control plane: the copy adopts the whole log again
        start = max(0, cursor - self._pin_base)
        pins = self._pins[start : start + _MAX_PINS_PER_ANSWER]
        return Snapshot(
            epoch=self.epoch,
            seq=self.seq,
            aliases=dict(self._table()) if full else None,
            agents=list(self._agents()) if full else None,
            flipping=sorted(self.flipping),
            draining=[DrainCount(name=n, version=v, inflight=0) for n, v in sorted(self.draining)],
            leaving=[
                ReplicaDrain(
                    agent_url=u,
                    inflight=0,
                    name=k[0] if k else None,
                    version=k[1] if k else None,
                )
                for u, k in sorted(self.leaving, key=lambda x: (x[0], x[1] or ("", 0)))
            ],
            pins=[PinRecord(session=p.session, name=p.name, version=p.version) for p in pins],
            pin_cursor=self._pin_base + start + len(pins),
            lease_s=self.lease_s,
            session_idle_s=self.sessions.idle_s,
        )

    def _news(self, c: _Copy, cursor: int) -> bool:
        return (
            c.epoch != self.epoch
            or c.acked < self.seq
            or self.pin_seq > cursor
            or any(k not in c.draining for k in self.draining)
            or any(u not in c.leaving for u in self.leaving)
        )

    async def sync(self, r: CopyReport, wait: float) -> Snapshot:
        """A copy's long poll: answered at once when something is new for it, else after
        ``wait`` seconds (a heartbeat: same seq, nothing else)."""
        c = self.report(r)
        if not self._news(c, r.pin_cursor):
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)
        return self.snapshot(c, r.pin_cursor)

    # --- flips ---------------------------------------------------------------------------------

    def fenced(self, c: _Copy, now: float | None = None) -> bool:
        """Silent past its lease (and the margin): it refuses adapter requests by now."""
        now = self._clock() if now is None else now
        return now - c.last_seen > self.lease_s + self.margin_s

    def _forget_dead(self) -> None:
        now = self._clock()
        for cid, c in list(self.copies.items()):
            if now - c.last_seen > self.forget_s:
                del self.copies[cid]
                log.warning("data-plane copy %s silent for %.0fs: forgotten", cid, self.forget_s)

    def lagging(self, seq: int) -> list[str]:
        """Live copies that neither acknowledged ``seq`` nor are fenced."""
        self._forget_dead()
        now = self._clock()
        return [
            cid
            for cid, c in self.copies.items()
            if not (c.epoch == self.epoch and c.acked >= seq) and not self.fenced(c, now)
        ]

    async def wait_acked(self, seq: int) -> list[str]:
        """Wait until every live copy acknowledged ``seq`` or is fenced; the ones fenced."""
        while True:
            lagging = self.lagging(seq)
            if not lagging:
                break
            acked = self._acked
            # Wake at the earliest moment one of them becomes fenced, or at the next report.
            now = self._clock()
            due = min(
                self.copies[cid].last_seen + self.lease_s + self.margin_s - now for cid in lagging
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acked.wait(), max(0.01, due + 0.01))
        fenced = [
            cid for cid, c in self.copies.items() if not (c.epoch == self.epoch and c.acked >= seq)
        ]
        for cid in fenced:
            log.warning("data-plane copy %s did not acknowledge seq %d: fenced", cid, seq)
        return fenced

    @contextlib.asynccontextmanager
    async def flip(self, name: str, pins_sessions: bool):
        """Around a flip of ``name`` (the block makes it durable). If the name pins sessions,
        first put it in ``flipping`` and wait until every copy acknowledged that, with the pins
        it made before. After a block that succeeded, wait until every live copy acknowledged
        the new table or is fenced: the flip is everyone's before it is answered."""
        prepared = bool(pins_sessions and self.copies)
        if prepared:
            self.flipping.add(name)
            await self.wait_acked(self.bump())
        done = False
        try:
            yield
            done = True
        finally:
            self.flipping.discard(name)
            if done or prepared:
                seq = self.bump()
                if done:
                    await self.wait_acked(seq)

    def pin(self, session: str, name: str) -> PinRecord:
        """A session's pin on ``name`` while its flip is under way: the authoritative one (made
        now, on the newest version the table holds, if the session has none)."""
        entry = self._table().get(name)
        newest = entry.version if entry is not None else 0
        version = self.sessions.pin(session, name, newest)
        self.log_pins(self.sessions.take_news())
        return PinRecord(session=session, name=name, version=version)

    # --- drains --------------------------------------------------------------------------------

    def count(self, name: str, version: int) -> int:
        """Requests in flight for (name, version) on every live copy, as last reported."""
        return self._sum(lambda c: c.draining.get((name, version)))

    def count_on(self, agent_url: str, key: tuple[str, int] | None = None) -> int:
        """Requests in flight on the replica at ``agent_url`` (for ``key`` only, if given) on
        every live copy, as reported."""
        return self._sum(lambda c: c.leaving.get((agent_url, key)))

    def _sum(self, reported: Callable[[_Copy], int | None]) -> int:
        self._forget_dead()
        return sum(reported(c) or 0 for c in self.copies.values() if not self.fenced(c))

    async def wait_drained(self, name: str, version: int, deadline: float) -> int:
        """Ask every copy for its count of (name, version) and wait until all are 0 or the
        deadline (monotonic) passes; the count left."""
        key = (name, version)
        self.draining.add(key)
        try:
            return await self._wait_zero(lambda c: c.draining.get(key), deadline)
        finally:
            self.draining.discard(key)

    async def wait_replica_drained(
        self, agent_url: str, deadline: float, key: tuple[str, int] | None = None
    ) -> int:
        """Ask every copy for its requests in flight on the replica at ``agent_url`` (leaving
        the fleet; or, with ``key``, for that version only: it is being evicted there) and wait
        until all are 0 or the deadline passes; the count left."""
        mark = (agent_url, key)
        self.leaving.add(mark)
        try:
            return await self._wait_zero(lambda c: c.leaving.get(mark), deadline)
        finally:
            self.leaving.discard(mark)

    async def _wait_zero(self, reported: Callable[[_Copy], int | None], deadline: float) -> int:
        """Until every live copy reported (not None) a count, and they sum to 0; or the
        deadline. A copy that has not reported counts as 1 at the deadline."""
        self._wake()
        while True:
            live = [c for c in self.copies.values() if not self.fenced(c)]
            answered = all(reported(c) is not None for c in live)
            left = self._sum(reported)
            if (answered and left == 0) or self._clock() >= deadline:
                return left if answered else max(left, 1)
            acked = self._acked
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acked.wait(), max(0.01, deadline - self._clock()))

    # --- status --------------------------------------------------------------------------------

    def status(self) -> CopyList:
        self._forget_dead()
        now = self._clock()
        return CopyList(
            epoch=self.epoch,
            seq=self.seq,
            copies=[
                CopyStatus(
                    copy_id=c.copy_id,
                    url=c.report.url,
                    pid=c.report.pid,
                    acked=c.acked,
                    current=c.epoch == self.epoch
                    and c.acked >= self.seq
                    and now - c.last_seen <= self.lease_s,
                    fenced=self.fenced(c, now) and c.acked < self.seq,
                    last_sync_s=now - c.last_seen,
                    inflight=c.report.inflight,
                    healthy_replicas=c.report.healthy_replicas,
                    requests=c.report.requests,
                )
                for c in sorted(self.copies.values(), key=lambda c: c.copy_id)
            ],
        )
