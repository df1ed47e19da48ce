"""A data-plane copy's side of the control plane: the table it serves by, and when to trust it.

``CopyTable`` is the last snapshot this copy acknowledged (``TableView``). ``Syncer`` keeps it
current with a long poll to the control plane (``router/copies.py``): each sync reports what the
copy applied (the acknowledgement), the session pins it made and its in-flight counts for the
versions being drained, and is answered when the table changes or after a heartbeat interval.

When to trust the table (``admit``, before a request is resolved):

- The table is current for ``lease_s`` after the copy *sent* the sync whose answer it holds.
- A copy whose own event loop stopped for longer than ``stall_s`` (it was frozen, SIGSTOPped,
  starved) may have missed a flip that the control plane made after fencing it: it answers no
  adapter request (503 ``table_stale``, retryable) until a sync it sent after waking is
  answered. That usually takes one round trip: the answer is waiting in its socket.
- A copy that kept running while the control plane went silent (killed, restarted, frozen)
  serves the last table it acknowledged: no flip can be made without the control plane, and
  the control plane waits for this copy's acknowledgement of every flip, or for its lease to run
  out (which only a frozen copy lets happen, see above).

While a flip of a name that pins sessions is under way, a session this copy does not know asks
the control plane for its pin first, so that a session that started on the old version on
another copy keeps it here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable

from lorafleet.clients.router import AsyncRouterClient
from lorafleet.dataplane.balancer import Balancer
from lorafleet.dataplane.sessions import Pin
from lorafleet.errors import LorafleetError, NotFound, TableStale
from lorafleet.protocol.router import AliasEntry, CopyReport, DrainCount, ReplicaDrain, Snapshot

__all__ = ["CopyTable", "Syncer"]

Leaving = tuple[str, tuple[str, int] | None]

log = logging.getLogger("lorafleet.dataplane.sync")


class CopyTable:
    """The routing table of one data-plane copy: the last snapshot it acknowledged."""

    def __init__(self) -> None:
        self.aliases: dict[str, AliasEntry] = {}
        self.epoch: str | None = None
        self.seq = 0
        self.flipping: frozenset[str] = frozenset()
        self.draining: list[tuple[str, int]] = []
        self.leaving: list[Leaving] = []
        """(agent URL, None) for a replica leaving; (agent URL, (name, version)) for a version
        being evicted from it."""
        self.pin_cursor = 0

    def apply(self, snap: Snapshot) -> None:
        if snap.aliases is not None:
            self.aliases = snap.aliases
        self.epoch, self.seq = snap.epoch, snap.seq
        self.flipping = frozenset(snap.flipping)
        self.draining = [(d.name, d.version) for d in snap.draining]
        self.leaving = [
            (d.agent_url, None if d.name is None or d.version is None else (d.name, d.version))
            for d in snap.leaving
        ]
        self.pin_cursor = snap.pin_cursor


class Syncer:
    """Keeps one copy's ``CopyTable`` current and says when it may be trusted (see above)."""

    def __init__(
        self,
        control: AsyncRouterClient,
        table: CopyTable,
        balancer: Balancer,
        *,
        copy_id: str,
        url: str | None = None,
        wait_s: float = 1.0,
        stall_s: float = 1.0,
        fence_wait_s: float = 2.0,
        on_agents: Callable[[list[str]], None] | None = None,
        requests: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.control = control
        self.table = table
        self.balancer = balancer
        self.copy_id = copy_id
        self.url = url
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.fence_wait_s = fence_wait_s
        self.on_agents = on_agents
        self.requests = requests
        self._clock = clock
        self.started_at = time.time()
        self.lease_until = 0.0
        """Monotonic time until which the table is current (its last sync's send time + lease)."""
        self.stalled_since: float | None = None
        self.reachable = False
        """The last sync was answered (False: the control plane did not answer it)."""
        self.synced = asyncio.Event()
        """Set once the first snapshot is applied."""
        self._fresh = asyncio.Event()
        self._poke = asyncio.Event()
        self._last_tick = clock()
        self._tasks: list[asyncio.Task] = []
        self._watching: dict[tuple[str, int] | str, asyncio.Task] = {}
        self._unsent: list[Pin] = []
        self._reports = 0
        """Reports built so far; ``_taken``: the latest of them the control plane answered."""
        self._taken = 0

    # --- trust ---------------------------------------------------------------------------------

    def _check_stall(self) -> None:
        now = self._clock()
        if now - self._last_tick > self.stall_s and self.stalled_since is None:
            self.stalled_since = now
            log.warning(
                "this copy stalled for %.1fs: its table is fenced until it syncs",
                now - self._last_tick,
            )
            self.poke()  # re-sync now, and ask for an immediate answer
        self._last_tick = now

    @property
    def current(self) -> bool:
        return self._clock() < self.lease_until and self.stalled_since is None

    @property
    def fenced(self) -> bool:
        self._check_stall()
        return self.stalled_since is not None

    async def admit(self, models: Iterable[object], session: str | None) -> None:
        """Before a request naming ``models`` is resolved: wait (briefly) for a table this copy
        may trust, and for a flipping name, for the session's pin. Raises ``TableStale``."""
        names = [m for m in models if isinstance(m, str) and (m in self.table.aliases or "@v" in m)]
        if not names:
            return  # the base model: no version to be wrong about
        if self.fenced:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._until_trusted(), self.fence_wait_s)
            if self.fenced:
                raise TableStale(
                    "this data-plane copy was cut off from the control plane long enough to miss "
                    "a flip, and has not synced since; retry (another copy, or this one shortly)"
                )
        if session is None or not self.table.flipping:
            return
        sessions = self.balancer.sessions
        for name in names:
            if name in self.table.flipping and sessions.pinned(session, name) is None:
                try:
                    pin = await self.control.pin(session, name)
                except (LorafleetError, TimeoutError) as exc:
                    raise TableStale(
                        f"{name!r} is being flipped and the control plane did not answer for "
                        f"session {session!r}'s pin ({exc}); retry"
                    ) from exc
                sessions.adopt([Pin(pin.session, pin.name, pin.version)])

    async def warm(self, name: str, version: int, more: bool = False) -> None:
        """Have the control plane place a cold version (``more``: on one more replica), then
        wait until this copy's table lists a replica for it (the caller bounds the wait)."""
        await self.control.warm(name, version, more=more)
        while not self._holders(name, version):
            await self.flush(5.0)

    async def resolve(self, name: str) -> bool:
        """Have the control plane register ``name`` from a watched directory if it is not in
        the table, then wait until this copy's table has it. False: it is nowhere."""
        try:
            await self.control.resolve(name)
        except NotFound:
            return False
        while name not in self.table.aliases:
            await self.flush(5.0)
        return True

    def _holders(self, name: str, version: int) -> list[str]:
        entry = self.table.aliases.get(name)
        ref = (
            None
            if entry is None
            else next((v for v in entry.window() if v.version == version), None)
        )
        return [] if ref is None else ref.replicas

    async def _until_trusted(self) -> None:
        while self.fenced:
            fresh = self._fresh
            await fresh.wait()

    # --- the sync loop -------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name="sync"),
            asyncio.create_task(self._tick(), name="stall-watch"),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._watching.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.stall_s / 4)
            self._check_stall()

    def poke(self) -> None:
        """Sync now (a drained count, new pins worth reporting)."""
        self._poke.set()

    async def flush(self, timeout: float) -> bool:
        """Send what this copy has to report (a finished session) now, and wait until the
        control plane took it, up to ``timeout`` seconds; whether it did."""
        mark = self._reports
        self.poke()
        deadline = self._clock() + timeout
        while self._taken <= mark:
            left = deadline - self._clock()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._fresh.wait(), left)
        return True

    def report(self) -> CopyReport:
        b = self.balancer
        self._reports += 1
        self._unsent.extend(b.sessions.take_news())
        return CopyReport(
            copy_id=self.copy_id,
            epoch=self.table.epoch,
            acked=self.table.seq,
            pin_cursor=self.table.pin_cursor,
            pins=[
                {"session": p.session, "name": p.name, "version": p.version}
                for p in self._unsent[:100_000]
            ],
            draining=[
                DrainCount(name=n, version=v, inflight=b.count(n, v))
                for n, v in self.table.draining
            ],
            leaving=[
                ReplicaDrain(
                    agent_url=u,
                    inflight=b.count_on(u, key),
                    name=key[0] if key else None,
                    version=key[1] if key else None,
                )
                for u, key in self.table.leaving
            ],
            used=self._used(),
            url=self.url,
            pid=os.getpid(),
            inflight=sum(r.inflight for r in b.replicas),
            healthy_replicas=sum(1 for r in b.replicas if r.routable),
            requests=self.requests(),
            started_at=self.started_at,
        )

    async def sync_once(self, wait: float) -> None:
        """One sync: report, wait for the answer, apply it. Raises ``LorafleetError``."""
        report = self.report()
        n = self._reports
        sent_at = self._clock()
        snap = await self.control.sync(report, wait)
        del self._unsent[: len(report.pins)]
        self._taken = max(self._taken, n)
        self._apply(snap, sent_at)

    def _apply(self, snap: Snapshot, sent_at: float) -> None:
        if snap.agents is not None and self.on_agents is not None:
            self.on_agents(snap.agents)
        self.table.apply(snap)
        sessions = self.balancer.sessions
        sessions.idle_s = snap.session_idle_s
        if snap.pins:
            sessions.adopt(Pin(p.session, p.name, p.version) for p in snap.pins)
        self.lease_until = sent_at + snap.lease_s
        if self.stalled_since is not None and sent_at > self.stalled_since:
            log.warning("this copy synced again: its table is trusted (seq %d)", snap.seq)
            self.stalled_since = None
        self._watch_drains()
        self.reachable = True
        self.synced.set()
        self._fresh.set()
        self._fresh = asyncio.Event()

    def _used(self) -> dict[str, float]:
        now, last, aliases = time.monotonic(), self.balancer.last_used, self.table.aliases
        for key in [k for k in last if k[0] not in aliases]:
            del last[key]  # a name gone from the table is used no more
        return {f"{n}@v{v}": max(0.0, now - t) for (n, v), t in last.items()}

    def _watch_drains(self) -> None:
        """Sync again as soon as a version being drained, or a replica leaving, has nothing in
        flight here."""
        keys: set[tuple[str, int] | Leaving] = {*self.table.draining, *self.table.leaving}
        for key, task in list(self._watching.items()):
            if key not in keys:
                task.cancel()
                del self._watching[key]
        for key in keys - set(self._watching):
            self._watching[key] = asyncio.create_task(self._drained(key))

    async def _drained(self, key: tuple[str, int] | Leaving) -> None:
        if isinstance(key[0], str) and isinstance(key[1], tuple | None):
            # A replica's count has no waiters (it moves with every request): look often.
            while self.balancer.count_on(*key):  # type: ignore[arg-type]
                await asyncio.sleep(0.02)
        else:
            await self.balancer.wait_drained(*key, 3600.0)
        self.poke()

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            self._poke.clear()
            wait = 0.0 if self.stalled_since is not None else self.wait_s
            poll = asyncio.ensure_future(self.sync_once(wait))
            poked = asyncio.ensure_future(self._poke.wait())
            try:
                await asyncio.wait({poll, poked}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                poked.cancel()
            if not poll.done():
                # Something worth reporting now: this poll goes, the next one carries it.
                poll.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await poll
                continue
            exc = poll.exception()
            if exc is None:
                backoff = 0.1
                continue
            if self.reachable:
                log.warning("control plane unreachable (%s): serving the last table", exc)
            self.reachable = False
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)
