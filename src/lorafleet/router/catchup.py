"""Catch-up: a replica that lacks a routable version gets it from a peer, never the trainer.

The router knows which replicas hold each routable version (``RoutableVersion.replicas``) and
which are lagging (``AliasEntry.lagging``). One loop per router looks at every replica in
rotation: it lists what the agent holds and compares it with the table.

- A replica listed for a version it no longer holds with the version's digest (its store was
  wiped, its agent restarted empty) is taken off that version at once: it is never routed a
  version it was not verified for.
- A replica that lacks a version is fed from a peer that holds it, by the one install path
  (``lorafleet.install.ReplicaInstall.from_peer``): the lagging agent opens an upload session
  that takes relayed bytes from one credential minted for this catch-up alone (the relay's
  per-publication credential, ``agent/relay.py``); the peer agent PUTs the files it holds into
  it; the lagging agent verifies each by size and sha-256 as for any upload, commits,
  loads, and proves the version with its application probe and, when the peer was proven with
  the trainer's canary, with that canary (``protocol/canary.py``). Only then is it listed for the
  version (``AliasStore.add_holder``, which refuses a claim for other bytes).

A lagging replica whose engine is full (other names filled it meanwhile) gets a slot from the
placer, which evicts its least recently used version of another name, as for a publication.

A name whose publish lease is held is left alone: a publication is under way and owns its
replicas until its flip. A failed catch-up is recorded on the name's lagging state and tried again
after a backoff (1 s doubling to 30 s). Versions are caught up oldest first (an agent refuses a
version older than one it has loaded), and only for versions whose flip named their digest (every
Publisher's does) under immutable engine names (``name@vN``): an in-place name is not the
router's to restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from lorafleet._http import async_client
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.dataplane.balancer import Balancer, Replica
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.errors import InstallFailed, LorafleetError
from lorafleet.install import InstallTimeouts, ReplicaInstall, feed_tree
from lorafleet.protocol.agent import (
    AdapterRecord,
    AdapterState,
    RelayAccept,
    credential_digest,
    engine_name,
)
from lorafleet.protocol.relay import RelayMeasure, RelayRates
from lorafleet.protocol.router import AliasEntry, RoutableVersion
from lorafleet.router.table import AliasStore

__all__ = ["CatchUp"]

log = logging.getLogger("lorafleet.router.catchup")

_HELD = (AdapterState.LOADED, AdapterState.ACTIVE)
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0


TREE_MIN = 4
"""Lagging replicas per tree at least: fewer share one tree (and one source peer)."""


@dataclass(eq=False)
class _Feed:
    """Replicas that need one version, gathered to be fed together."""

    members: list = field(default_factory=list)
    """(replica, its source peer, the future its round waits on)."""
    task: asyncio.Task | None = None


class CatchUpFailed(Exception):
    """One catch-up step failed; the message says which and why."""


def holds(records: list[AdapterRecord], name: str, ref: RoutableVersion) -> AdapterRecord | None:
    """The record by which an agent holds ``ref`` (loaded, with its digest, not disproven)."""
    for r in records:
        if (
            r.name == name
            and r.version == ref.version
            and r.state in _HELD
            and r.mode == "versioned"
            and (ref.digest is None or r.digest == ref.digest)
            and r.application != "not_applied"
            and (r.canary is None or r.canary.outcome != "failed")
        ):
            return r
    return None


class CatchUp:
    """The router's catch-up loop (see the module docstring)."""

    def __init__(
        self,
        store: AliasStore,
        balancer: Balancer,
        metrics: RouterMetrics,
        *,
        token: str | None,
        interval_s: float = 1.0,
        call_timeout_s: float = 10.0,
        transfer_timeout_s: float = 600.0,
        gather_s: float = 0.5,
        on_change: Callable[[], None] | None = None,
        make_room: Callable[[Replica, int, frozenset[str]], Awaitable[object]] | None = None,
    ) -> None:
        self.store = store
        self.balancer = balancer
        self.metrics = metrics
        self.token = token
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.on_change = on_change
        self.make_room = make_room
        """The placer's eviction (``Placer.make_room``): a lagging replica whose engine other
        names filled while it lagged gets a slot for the version it catches up on, as a
        publication's replicas do."""
        self._http: httpx.AsyncClient | None = None
        self._busy: dict[str, asyncio.Task] = {}
        self._retry: dict[tuple[str, str], tuple[float, float]] = {}
        """(replica, name) -> (monotonic time of the next try, the delay that led to it)."""
        self._task: asyncio.Task | None = None
        self._rr = 0
        self.gather_s = gather_s
        self._feeds: dict[tuple[str, int, str], _Feed] = {}
        """(name, version, digest) -> the replicas waiting to be fed it together."""
        self._sending: dict[str, int] = {}
        """Source agent URL -> trees it is feeding now (a tree goes to the least busy peer)."""
        self.progress: dict[tuple[str, int, str], list[int]] = {}
        """(name, version, source replica) -> [replicas fed so far, replicas in that tree]:
        the trees under way (``lorafleet status``)."""
        self.relay_rates = RelayRates()
        """What the next tree is planned with: each tree that landed whole refines them
        (``RelayRates.learned``), as the Publisher's do."""
        self.learned_from = 0

    def _learn(self, m: RelayMeasure) -> None:
        self.relay_rates = self.relay_rates.learned(m)
        self.learned_from += 1

    def client(self, url: str) -> AsyncAgentClient:
        assert self._http is not None
        return AsyncAgentClient(url, self.token, client=self._http)

    def start(self) -> None:
        self._http = async_client(timeout=httpx.Timeout(self.call_timeout_s, connect=3.0))
        self._task = asyncio.create_task(self._run(), name="catch-up")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._busy.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._http is not None:
            await self._http.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # never let one bad round stop catch-up
                log.exception("catch-up round failed")

    def tick(self) -> None:
        """Start a round for every replica in rotation that has none running."""
        for r in list(self.balancer.replicas):
            rid = r.replica_id
            if not rid or not r.routable or rid in self._busy:
                continue
            task = asyncio.create_task(self.replica_round(r), name=f"catch-up {rid}")
            self._busy[rid] = task
            task.add_done_callback(lambda _t, rid=rid: self._busy.pop(rid, None))

    # -- one replica ----------------------------------------------------------------------------
    async def replica_round(self, r: Replica) -> None:
        """Compare what ``r``'s agent holds with the table; drop false claims, catch up gaps."""
        rid = r.replica_id
        assert rid is not None
        seqs = self._quiet_names()
        # What the table listed this replica for before the listing: a holder added meanwhile
        # (an on-demand load) is not missing from a listing taken before it loaded.
        before = {
            (n, v.version) for n, e in self.store.aliases.items() for v in e.window()
            if rid in v.replicas
        }  # fmt: skip
        try:
            records = await self.client(r.agent_url).list_adapters()
        except LorafleetError:
            return  # its health poll takes it out if it stays silent
        now = self._quiet_names()
        for name, entry in list(self.store.aliases.items()):
            if seqs.get(name) is None or now.get(name) != seqs[name]:
                continue  # a publication holds the name, or flipped it since the listing
            changed = False
            for ref in sorted(entry.window(), key=lambda v: v.version):
                if ref.engine_name != engine_name(name, ref.version) or ref.digest is None:
                    # In place, the plain name is not the router's to restore; and a version
                    # flipped without a digest (by hand, not by a Publisher) names no bytes.
                    continue
                mine = holds(records, name, ref)
                if rid not in ref.replicas and not entry.placed_on(rid):
                    continue  # evicted here to make room: placed elsewhere, loaded on demand
                if rid in ref.replicas:
                    if mine is None and (name, ref.version) in before:
                        why = "listed, but its agent no longer holds it with this digest"
                        changed |= self.store.drop_holder(name, ref.version, rid, why)
                        log.warning("replica %s: %s v%d %s", rid, name, ref.version, why)
                    continue
                newer = [
                    x.version
                    for x in records
                    if x.name == name and x.state in _HELD and x.version > ref.version
                ]
                if newer or not self._due(rid, name):
                    continue  # an agent refuses a version older than one it has loaded
                try:
                    await self.catch_up(r, name, entry, ref, mine)
                except (CatchUpFailed, LorafleetError, TimeoutError) as exc:
                    self._failed(rid, name, f"catch-up of v{ref.version}: {exc}")
                    break
                self._retry.pop((rid, name), None)
                self.metrics.catch_ups.labels("ok").inc()
                changed = True
                try:
                    records = await self.client(r.agent_url).list_adapters()
                except LorafleetError:
                    return
            if changed and self.on_change is not None:
                self.on_change()
            if changed:
                await self._release_left_behind(r, name)

    def _quiet_names(self) -> dict[str, int]:
        """Name -> the seq of its entry, for the names no publication holds right now."""
        return {n: e.seq for n, e in self.store.aliases.items() if self.store.lease_of(n) is None}

    def _due(self, rid: str, name: str) -> bool:
        got = self._retry.get((rid, name))
        return got is None or time.monotonic() >= got[0]

    def _failed(self, rid: str, name: str, why: str) -> None:
        _, delay = self._retry.get((rid, name), (0.0, BACKOFF_MIN_S / 2))
        delay = min(BACKOFF_MAX_S, delay * 2)
        self._retry[(rid, name)] = (time.monotonic() + delay, delay)
        self.metrics.catch_ups.labels("failed").inc()
        self.store.note_lag(name, rid, why, retry_at=time.time() + delay)
        log.warning("replica %s: %s; next try in %.0fs", rid, why, delay)

    def _source(self, ref: RoutableVersion, not_: Replica) -> Replica | None:
        peers = [
            p
            for p in self.balancer.candidates(ref.replicas)
            if p is not not_ and p.agent_url != not_.agent_url
        ]
        if not peers:
            return None
        self._rr = (self._rr + 1) % len(peers)
        return peers[self._rr]

    async def catch_up(
        self,
        r: Replica,
        name: str,
        entry: AliasEntry,
        ref: RoutableVersion,
        mine: AdapterRecord | None,
    ) -> None:
        """Get ``ref`` onto ``r`` from a peer, load it, prove it, list it. Raises
        ``CatchUpFailed`` / ``LorafleetError`` / ``TimeoutError``."""
        rid, v = r.replica_id, ref.version
        assert rid is not None
        target = self.client(r.agent_url)
        bound = self.call_timeout_s
        timeouts = InstallTimeouts(
            call_s=bound, transfer_s=self.transfer_timeout_s, load_s=self.transfer_timeout_s
        )
        src = self._source(ref, r)
        # The trainer's canary the holders were proven with proves this copy too.
        canary = None
        if src is not None:
            canary = await asyncio.wait_for(self.client(src.agent_url).canary(name, v), bound)
        if mine is None:
            if src is None:
                raise CatchUpFailed("no peer in rotation holds it")
            # Other bytes under this engine name (a failed attempt's leftover) go first.
            for rec in await asyncio.wait_for(target.list_adapters(), bound):
                if rec.name == name and rec.version == v and rec.digest != ref.digest:
                    await asyncio.wait_for(target.unload(name, v), bound)
            if self.make_room is not None:
                await self.make_room(r, 1, frozenset({name}))
            try:
                install = await self._copied(r, src, name, v, ref, timeouts)
            except InstallFailed as exc:
                raise CatchUpFailed(f"peer {src.replica_id}: {exc}") from exc
        else:
            install = ReplicaInstall(target, name, v, None, timeouts)
        rec = await install.prove(canary)
        if ref.digest is not None and rec.digest != ref.digest:
            raise CatchUpFailed(f"it verified other bytes ({rec.digest[:12]})")
        current = self.store.aliases.get(name)
        if all(x is not r for x in self.balancer.replicas):
            raise CatchUpFailed("the replica left the fleet meanwhile")
        if current is None or self.store.lease_of(name) is not None:
            raise CatchUpFailed("a publication started meanwhile; tried again after it")
        if v == current.version:
            await install.activate()
        if not self.store.add_holder(name, v, rec.digest, rid, rec.canary):
            raise CatchUpFailed(f"v{v} is no longer routable with digest {rec.digest[:12]}")
        log.info("replica %s caught up on %s v%d", rid, name, v)

    # -- trees ----------------------------------------------------------------------------------
    async def _copied(
        self,
        r: Replica,
        src: Replica,
        name: str,
        v: int,
        ref: RoutableVersion,
        timeouts: InstallTimeouts,
    ) -> ReplicaInstall:
        """``ref`` onto ``r`` from peers, staged and loaded. The replicas that need the same
        version within ``gather_s`` of each other (a rack back, a wiped fleet) are fed together
        through relay trees, one per source peer; one alone is fed by ``src`` directly."""
        key = (name, v, ref.digest or "")
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = _Feed()
            feed.task = asyncio.create_task(self._feed(key, ref, timeouts), name=f"feed {name}")
        got: asyncio.Future[ReplicaInstall] = asyncio.get_running_loop().create_future()
        feed.members.append((r, src, got))
        return await got

    async def _feed(self, key: tuple[str, int, str], ref: RoutableVersion, timeouts) -> None:
        name, v, digest = key
        feed = self._feeds[key]
        # Gather until no replica joined for gather_s (replicas that come back together are
        # seen by their rounds within a poll or two of each other), for 4 * gather_s at most.
        deadline = time.monotonic() + 4 * self.gather_s
        while True:
            seen = len(feed.members)
            await asyncio.sleep(self.gather_s)
            if len(feed.members) == seen or time.monotonic() >= deadline:
                break
        self._feeds.pop(key, None)
        members = [m for m in feed.members if not m[2].done()]
        try:
            await self._feed_members(name, v, digest or None, ref, members, timeouts)
        except Exception as exc:
            for _, _, got in members:
                if not got.done():
                    got.set_exception(exc)

    async def _feed_members(self, name, v, digest, ref, members, timeouts) -> None:
        member_urls = {r.agent_url for r, _, _ in members}
        sources = [
            p for p in self.balancer.candidates(ref.replicas) if p.agent_url not in member_urls
        ]
        if len(members) == 1 or not sources:
            # One replica (or no peer outside the group): each from its own source, directly.
            await asyncio.gather(
                *(self._one(r, src, name, v, digest, timeouts, got) for r, src, got in members)
            )
            return
        # One tree per source peer, the least busy first, as many as there are peers and at
        # most one per TREE_MIN members: the load spreads and each tree stays deep enough to
        # pay for itself.
        sources.sort(key=lambda p: (self._sending.get(p.agent_url, 0), p.inflight))
        trees = max(1, min(len(sources), -(-len(members) // TREE_MIN)))
        groups = [[(r, got) for r, _, got in members[k::trees]] for k in range(trees)]
        self.metrics.catch_up_trees.inc(trees)
        await asyncio.gather(
            *(
                self._tree(sources[k], group, name, v, digest, timeouts)
                for k, group in enumerate(groups)
            )
        )

    async def _one(self, r, src, name, v, digest, timeouts, got) -> None:
        try:
            got.set_result(
                await ReplicaInstall.copied_from_peer(
                    self.client(r.agent_url),
                    self.client(src.agent_url),
                    r.agent_url,
                    name,
                    v,
                    timeouts,
                    digest,
                )
            )
        except Exception as exc:  # the member's own round reports it
            got.set_exception(exc)

    async def _tree(self, src: Replica, group, name, v, digest, timeouts) -> None:
        """Feed ``group`` from ``src`` through one tree; a member whose copy did not land is
        fed from ``src`` directly, from scratch."""
        peer = self.client(src.agent_url)
        self._sending[src.agent_url] = self._sending.get(src.agent_url, 0) + 1
        key = (name, v, src.replica_id or src.agent_url)
        self.progress[key] = [0, len(group)]
        try:
            manifest = await asyncio.wait_for(peer.manifest(name, v), self.call_timeout_s)
            if digest is not None and manifest.digest != digest:
                raise InstallFailed(f"the peer holds other bytes under v{v}")
            credential = secrets.token_urlsafe(32)
            accept = RelayAccept(credential_sha256=credential_digest(credential))
            installs = [
                ReplicaInstall(self.client(r.agent_url), name, v, manifest, timeouts)
                for r, _ in group
            ]
            opened = await asyncio.gather(
                # Not superseding, as ``ReplicaInstall.from_peer``: a newer never-activated
                # version there may be a publication in flight.
                *(x.open(supersede=False, relay=accept) for x in installs),
                return_exceptions=True,
            )
            live = [k for k, o in enumerate(opened) if not isinstance(o, BaseException)]
            for k, o in enumerate(opened):
                if isinstance(o, BaseException):
                    group[k][1].set_exception(o)
            failed = await feed_tree(
                [installs[k] for k in live],
                [group[k][0].agent_url for k in live],
                peer,
                credential,
                rates=self.relay_rates,
                on_measure=self._learn,
            )
            log.info(
                "catch-up of %s v%d: %d replicas fed through one tree from %s (%d direct)",
                name, v, len(live), src.replica_id, len(failed),
            )  # fmt: skip

            async def finish(j: int) -> None:
                k = live[j]
                r, got = group[k]
                x = installs[k]
                try:
                    if j in failed:
                        with contextlib.suppress(LorafleetError, TimeoutError):
                            await x.discard()
                        x = await ReplicaInstall.copied_from_peer(
                            x.client, peer, r.agent_url, name, v, timeouts, digest
                        )
                    else:
                        await x.commit()
                        await x.load()
                    self.progress[key][0] += 1
                    got.set_result(x)
                except Exception as exc:
                    with contextlib.suppress(LorafleetError, TimeoutError):
                        await x.discard()
                    got.set_exception(exc)

            await asyncio.gather(*(finish(j) for j in range(len(live))))
        finally:
            self._sending[src.agent_url] -= 1
            self.progress.pop(key, None)

    async def _release_left_behind(self, r: Replica, name: str) -> None:
        """Unload what ``r`` holds of ``name`` below the window: nothing routes to it there."""
        entry = self.store.aliases.get(name)
        if entry is None or self.store.lease_of(name) is not None:
            return
        window = {v.version for v in entry.window()}
        target = self.client(r.agent_url)
        with contextlib.suppress(LorafleetError, TimeoutError):
            for rec in await asyncio.wait_for(target.list_adapters(), self.call_timeout_s):
                if (
                    rec.name == name
                    and rec.version < min(window)
                    and rec.state != AdapterState.ACTIVE
                    and self.balancer.count(name, rec.version) == 0
                ):
                    await asyncio.wait_for(target.unload(name, rec.version), self.call_timeout_s)
