"""Placement: more adapters than engine slots (``docs/placement.md``).

Each engine holds a bounded number of adapters (its agent reports ``max_adapters``). When a
publication or an on-demand load needs a slot on a full replica, ``Placer.make_room`` evicts the
least recently used versions there, never one a publication is under way for, each in three
steps, so that no request fails because of an eviction:

1. the table takes the replica off the version and out of the name's placement
   (``AliasStore.evict_holder``), and every data-plane copy acknowledges that table: no new
   request for the version goes there;
2. the requests already sent there for the version finish (on this process and every copy,
   up to ``drain_s``; if they do not, the replica is listed again and another victim is tried);
3. the agent takes the version out of its engine and keeps its verified files (``evict``).

A version that is routable but held nowhere is cold. ``Placer.warm`` places it: on the replica
ranked first by rendezvous hashing of (name, replica) among those in rotation (the rule a
publication's placement set follows), preferring
one that already has the verified files, it makes room, loads the version (from that agent's
store, or from a peer's through the one install path, ``lorafleet.install.ReplicaInstall``),
proves it (the application probe, and the trainer's canary it was published with), and lists
it. Concurrent requests for one cold version share one load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from lorafleet._http import async_client
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.dataplane.balancer import Balancer, Replica
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.errors import (
    AdapterCold,
    EngineUnavailable,
    InstallFailed,
    LorafleetError,
    NoReplica,
    NoRoom,
    NotFound,
    ServiceError,
    TenantQuotaExceeded,
    VersionNotRoutable,
)
from lorafleet.install import InstallTimeouts, ReplicaInstall
from lorafleet.protocol.agent import AdapterRecord, AdapterState, engine_name
from lorafleet.protocol.placement import rendezvous
from lorafleet.protocol.router import RoomResult, WarmResult
from lorafleet.protocol.tenants import Tenant, Tenants
from lorafleet.router.copies import Copies
from lorafleet.router.sources import Reference, Sources
from lorafleet.router.table import AliasStore

__all__ = ["Placer"]

log = logging.getLogger("lorafleet.router.placement")

_HELD = (AdapterState.LOADED, AdapterState.ACTIVE)
_HAS_BYTES = (*_HELD, AdapterState.STAGED, AdapterState.FAILED)
"""Verified files on the agent (a failed load keeps them: the engine refused, not the bytes)."""
RANKED = 3
"""How many replicas, best first by rendezvous hashing, a cold version is tried on."""


@dataclass(eq=False)
class _Promise:
    """A slot made free for ``name`` on a replica, before the version that fills it loads."""

    name: str
    held: int
    """How many versions of ``name`` the replica held when it was made."""
    expiry: float


class Placer:
    """Slots, evictions and on-demand loads (see the module docstring)."""

    def __init__(
        self,
        store: AliasStore,
        balancer: Balancer,
        copies: Copies,
        metrics: RouterMetrics,
        *,
        token: str | None,
        call_timeout_s: float = 10.0,
        load_timeout_s: float = 120.0,
        drain_s: float = 30.0,
        promise_s: float = 300.0,
        grace_s: float = 5.0,
        shrink_after_s: float = 0.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.balancer = balancer
        self.copies = copies
        self.metrics = metrics
        self.token = token
        self.call_timeout_s = call_timeout_s
        self.load_timeout_s = load_timeout_s
        self.drain_s = drain_s
        self.promise_s = promise_s
        self.grace_s = grace_s
        self.shrink_after_s = shrink_after_s
        self._on_demand: dict[tuple[str, int], set[str]] = {}
        """(name, version) -> the replicas it was loaded on on demand (cold or grown): what an
        idle version gives back (``shrink``). Replicas a publication chose are never shrunk."""
        self._shrinker: asyncio.Task | None = None
        self._promised: dict[str, list[_Promise]] = {}
        self._caps: dict[str, tuple[int | None, float]] = {}
        self.on_change = on_change
        self._http: httpx.AsyncClient | None = None
        self._rooms: dict[str, asyncio.Lock] = {}
        self._warming: dict[tuple[str, int], asyncio.Task] = {}
        self._placed_at: dict[tuple[str, int], float] = {}
        self.tenants: Tenants | None = None
        """Tenants (``--tenants``): an on-demand load keeps a tenant within its ``max_slots``."""
        self.sources: Sources | None = None
        """Registrations by reference: a cold version no replica has the bytes of is loaded
        from its registered directory."""

    def client(self, url: str) -> AsyncAgentClient:
        if self._http is None:
            self._http = async_client(timeout=httpx.Timeout(self.call_timeout_s, connect=3.0))
        return AsyncAgentClient(url, self.token, client=self._http)

    def start(self) -> None:
        """Start the idle shrink (every few seconds) when ``shrink_after_s`` is set."""
        if self.shrink_after_s > 0 and self._shrinker is None:
            self._shrinker = asyncio.create_task(self._shrink_loop(), name="shrink")

    async def stop(self) -> None:
        if self._shrinker is not None:
            self._shrinker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shrinker
            self._shrinker = None
        for t in list(self._warming.values()):
            t.cancel()
        for t in list(self._warming.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._http is not None:
            await self._http.aclose()

    # -- use ------------------------------------------------------------------------------------

    def last_use(self, name: str, version: int) -> float:
        """Monotonic time (name, version) was last routed or placed, here or on any copy."""
        key = (name, version)
        return max(
            self.balancer.last_used.get(key, 0.0),
            self.copies.used.get(key, 0.0),
            self._placed_at.get(key, 0.0),
        )

    # -- room -----------------------------------------------------------------------------------

    async def make_room(
        self, r: Replica, need: int = 1, keep: frozenset[str] = frozenset()
    ) -> RoomResult:
        """Free ``need`` slots on ``r`` for names in ``keep`` by evicting its least recently used
        versions of other names. The slots are promised to ``keep``'s names until versions of
        them fill them (or ``promise_s`` passes): a concurrent call does not count them free.
        Raises ``NoRoom`` when that many cannot be freed."""
        try:
            got, _ = await self._room(r, need, keep)
        except (NoRoom, ServiceError):
            raise
        except (LorafleetError, TimeoutError) as exc:
            rid = r.replica_id or r.agent_url
            raise EngineUnavailable(f"replica {rid}'s agent did not answer: {exc}") from exc
        return got

    def listed(self, name: str, version: int) -> None:
        """``version`` of ``name`` was just listed on replicas (a flip): it counts as used now,
        so the next eviction does not take a version nobody had a chance to ask for yet."""
        self._placed_at[(name, version)] = time.monotonic()

    def prune(self) -> None:
        """Forget the use of versions no longer routable (run at every alias change)."""
        live = {(n, v.version) for n, e in self.store.aliases.items() for v in e.window()}
        for uses in (self.balancer.last_used, self.copies.used, self._placed_at, self._on_demand):
            for key in [k for k in uses if k not in live]:
                del uses[key]

    async def _within_slots(self, tenant: Tenant, name: str, v: int, more: bool) -> None:
        """Keep ``tenant`` within ``max_slots`` when one more replica is to hold ``name`` v:
        a cold version takes the slot of the tenant's own least recently used version (drained
        first, as any eviction); a queue that grew gets no replica past the quota. Raises
        ``TenantQuotaExceeded``."""
        while True:
            try:
                tenant.check_quota(self.store.aliases, name, None, slots=1)
                return
            except TenantQuotaExceeded:
                if more:
                    raise
                victims = sorted(
                    (
                        (self.last_use(n, x.version), n, x.version, rid)
                        for n, e in self.store.aliases.items()
                        if tenant.owns(n)
                        for x in e.window()
                        for rid in x.replicas
                        if (n, x.version) != (name, v)
                    ),
                )
                by_id = {x.replica_id: x for x in self.balancer.replicas if x.replica_id}
                for _, n, ver, rid in victims:
                    r = by_id.get(rid)
                    if r is not None and await self._shrink_one(r, n, ver):
                        self._on_demand.get((n, ver), set()).discard(rid)
                        break
                else:
                    raise

    # -- idle shrink ----------------------------------------------------------------------------

    async def _shrink_loop(self) -> None:
        tick = max(0.2, min(5.0, self.shrink_after_s / 4))
        while True:
            await asyncio.sleep(tick)
            try:
                await self.shrink()
            except Exception:  # tried again at the next tick
                log.exception("idle shrink failed")

    async def shrink(self) -> list[str]:
        """Evict the replicas versions were loaded on on demand, for every version nobody asked
        for in ``shrink_after_s`` (here or on any copy): an on-demand adapter left idle goes
        back to zero replicas, a grown one to those its publication chose. Each eviction drains
        first, as any. The ``(replica, engine name)`` pairs evicted."""
        done: list[str] = []
        now = time.monotonic()
        by_id = {x.replica_id: x for x in self.balancer.replicas if x.replica_id}
        for key, rids in list(self._on_demand.items()):
            name, v = key
            if key in self._warming or now - self.last_use(name, v) < self.shrink_after_s:
                continue
            for rid in sorted(rids):
                r = by_id.get(rid)
                if r is None or not await self._shrink_one(r, name, v):
                    rids.discard(rid)
                    continue
                rids.discard(rid)
                self.metrics.shrinks.inc()
                done.append(f"{rid} {engine_name(name, v)}")
            if not rids:
                self._on_demand.pop(key, None)
        return done

    async def _shrink_one(self, r: Replica, name: str, v: int) -> bool:
        async with self._rooms.setdefault(r.agent_url, asyncio.Lock()):
            agent = self.client(r.agent_url)
            try:
                records = await asyncio.wait_for(agent.list_adapters(), self.call_timeout_s)
            except (LorafleetError, TimeoutError):
                return False
            rec = next(
                (x for x in records if (x.name, x.version) == (name, v) and x.state in _HELD),
                None,
            )
            if rec is None or not self._evictable(r.replica_id or r.agent_url, rec):
                return False
            if not await self._evict(r, rec):
                return False
        log.info("%s v%d evicted from %s (idle, or its tenant's slots)", name, v, r.replica_id)
        return True

    async def _room(
        self, r: Replica, need: int, keep: frozenset[str]
    ) -> tuple[RoomResult, list[_Promise]]:
        rid = r.replica_id or r.agent_url
        async with self._rooms.setdefault(r.agent_url, asyncio.Lock()):
            agent = self.client(r.agent_url)
            cap = await self._cap(r.agent_url, agent)
            if cap is None:
                return RoomResult(replica_id=rid, free=need), []
            records = await asyncio.wait_for(agent.list_adapters(), self.call_timeout_s)
            held = [x for x in records if x.state in _HELD]
            promised = self._promises(r.agent_url, held)
            free = cap - len({x.engine_name for x in held}) - len(promised)
            now = time.monotonic()
            victims = sorted(
                (x for x in held if x.name not in keep and self._evictable(rid, x)),
                # Least recently used first; a version listed in the last ``grace_s`` last of
                # all (requests that waited for it may not have reached it yet).
                key=lambda x: (
                    now - self._placed_at.get((x.name, x.version), -1e9) < self.grace_s,
                    self.last_use(x.name, x.version),
                ),
            )
            evicted: list[str] = []
            while free < need and victims:
                victim = victims.pop(0)
                if await self._evict(r, victim):
                    free += 1
                    evicted.append(victim.engine_name)
            if free < need:
                raise NoRoom(
                    f"replica {rid} holds {cap - free} of its {cap} adapters (counting slots "
                    f"promised to loads under way) and none more could be evicted (in use by a "
                    f"publication, kept, or not drained in {self.drain_s:g}s); evicted "
                    f"{evicted or 'none'}"
                )
            expiry = time.monotonic() + self.promise_s
            mine = [
                _Promise(n, sum(1 for x in held if x.name == n), expiry)
                for n in sorted(keep)[:1] * need
            ]
            promised.extend(mine)
            return RoomResult(replica_id=rid, free=free - need, evicted=evicted), mine

    async def _has_free_slot(self, r: Replica, held: list[AdapterRecord]) -> bool:
        """Whether ``r``'s engine has a slot no version and no promised load takes."""
        try:
            cap = await self._cap(r.agent_url, self.client(r.agent_url))
        except (LorafleetError, TimeoutError):
            return False
        if cap is None:
            return True
        loaded = sum(1 for rec in held if rec.state in _HELD)
        return loaded + len(self._promised.get(r.agent_url, [])) < cap

    async def _cap(self, agent_url: str, agent: AsyncAgentClient) -> int | None:
        """The engine's adapter slots, as its agent reports them (asked once a minute)."""
        got = self._caps.get(agent_url)
        if got is None or got[1] < time.monotonic():
            info = await asyncio.wait_for(agent.info(), self.call_timeout_s)
            got = self._caps[agent_url] = (info.capabilities.max_adapters, time.monotonic() + 60)
        return got[0]

    def _evictable(self, rid: str, rec: AdapterRecord) -> bool:
        """Whether ``rec`` may be evicted from replica ``rid``: a versioned load of a name no
        publication holds, and either listed for ``rid`` (the table can take it off first) or
        of no routable version at all. A routable version loaded but not listed there is being
        installed (an on-demand load, a catch-up): never pulled from under it."""
        if rec.mode != "versioned" or self.store.lease_of(rec.name) is not None:
            return False
        entry = self.store.aliases.get(rec.name)
        ref = (
            None
            if entry is None
            else next((v for v in entry.window() if v.version == rec.version), None)
        )
        return ref is None or rid in ref.replicas

    def _promises(self, agent_url: str, held: list[AdapterRecord]) -> list[_Promise]:
        """The promises on a replica still owed: not expired, and not filled yet by a version
        of their name loaded since."""
        now = time.monotonic()
        left = [
            p
            for p in self._promised.get(agent_url, [])
            if p.expiry > now and sum(1 for x in held if x.name == p.name) <= p.held
        ]
        self._promised[agent_url] = left
        return left

    def _release(self, agent_url: str, mine: list[_Promise]) -> None:
        got = self._promised.get(agent_url, [])
        self._promised[agent_url] = [p for p in got if all(p is not m for m in mine)]

    async def _evict(self, r: Replica, rec: AdapterRecord) -> bool:
        """Take ``rec``'s version off ``r``: table, drain, engine. False if it did not drain."""
        rid = r.replica_id or r.agent_url
        name, version = rec.name, rec.version
        members = [x.replica_id for x in self.balancer.replicas if x.replica_id]
        listed = self.store.evict_holder(name, version, rid, members)
        self._changed()
        key = (name, version)
        deadline = time.monotonic() + self.drain_s
        if listed:
            # Every copy serves the table without it before its requests are counted.
            await self.copies.wait_acked(self.copies.seq)
            while self.balancer.count_on(r.agent_url, key) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            left = self.balancer.count_on(r.agent_url, key)
            left += await self.copies.wait_replica_drained(r.agent_url, deadline, key)
            if left:
                log.warning("%s v%d on %s did not drain (%d left): kept", name, version, rid, left)
                self._relist(rid, rec, listed)
                return False
        elif self.balancer.count(name, version) + self.copies.count(name, version):
            return False  # no longer routable, still finishing (a retired version draining)
        try:
            agent = self.client(r.agent_url)
            await asyncio.wait_for(agent.evict(name, version), self.call_timeout_s)
        except (LorafleetError, TimeoutError) as exc:
            # The agent still lists it in its engine: listed again, so it is neither lost to
            # routing nor a slot nothing may evict.
            log.warning("evicting %s v%d from %s failed: %s", name, version, rid, exc)
            self._relist(rid, rec, listed)
            return False
        self._on_demand.get(key, set()).discard(rid)
        self.metrics.evictions.inc()
        log.info("evicted %s v%d from %s", name, version, rid)
        return True

    def _relist(self, rid: str, rec: AdapterRecord, listed: bool) -> None:
        """An eviction that did not happen: ``rid`` holds ``rec``'s version again."""
        if listed and rec.digest:
            self.store.add_holder(rec.name, rec.version, rec.digest, rid, rec.canary)
            self._changed()

    # -- on demand ------------------------------------------------------------------------------

    async def resolve(self, name: str) -> bool:
        """Whether ``name`` is in the table, after registering it from a watched directory
        that holds it (``Sources.resolve``)."""
        if name in self.store.aliases:
            return True
        return self.sources is not None and await self.sources.resolve(name)

    async def warm(self, name: str, version: int | None = None, more: bool = False) -> WarmResult:
        """Place ``version`` of ``name`` (None: the newest) on a replica if no replica in
        rotation holds it; with ``more``, on one more replica than holds it now (its queue
        grew). One load per version at a time however many ask. Raises ``NotFound``,
        ``VersionNotRoutable``, ``AdapterCold`` (it could be placed nowhere: the reason)."""
        entry = self.store.aliases.get(name)
        if entry is None:
            raise NotFound(f"no adapter {name!r}")
        v = entry.version if version is None else version
        ref = next((x for x in entry.window() if x.version == v), None)
        if ref is None:
            raise VersionNotRoutable(f"{name!r} v{v} is not routable")
        key = (name, v)
        task = self._warming.get(key)
        if task is None:
            held = self.balancer.candidates(ref.replicas)
            if held and (not more or len(held) >= len(self.balancer.candidates(None))):
                return WarmResult(name=name, version=v, replicas=list(ref.replicas))
            task = asyncio.create_task(self._timed(name, v, more), name=f"warm {name}@v{v}")
            self._warming[key] = task
            task.add_done_callback(lambda _t: self._warming.pop(key, None))
        return await asyncio.shield(task)

    async def _timed(self, name: str, v: int, more: bool) -> WarmResult:
        t0 = time.perf_counter()
        why = "more" if more else "cold"
        try:
            got = await self._place(name, v, more)
        except BaseException:
            self.metrics.on_demand_loads.labels(why, "failed").inc()
            raise
        self.metrics.on_demand_loads.labels(why, "ok").inc()
        if not more:
            self.metrics.cold_start.observe(time.perf_counter() - t0)
        return got

    async def _place(self, name: str, v: int, more: bool = False) -> WarmResult:
        entry = self.store.aliases[name]
        ref = next(x for x in entry.window() if x.version == v)
        if ref.engine_name != engine_name(name, v) or ref.digest is None:
            raise AdapterCold(f"{name!r} v{v} is placed nowhere and is not the router's to load")
        tenant = self.tenants.owner(name) if self.tenants is not None else None
        if tenant is not None and tenant.max_slots is not None:
            await self._within_slots(tenant, name, v, more)
        routable = {x.replica_id: x for x in self.balancer.replicas if x.replica_id and x.routable}
        if not routable:
            raise NoReplica("no replica in rotation to load it on")
        ranked = [routable[i] for i in rendezvous(name, sorted(routable))]
        listings = await asyncio.gather(
            *(
                asyncio.wait_for(self.client(x.agent_url).list_adapters(), self.call_timeout_s)
                for x in ranked
            ),
            return_exceptions=True,
        )
        has: dict[str, AdapterRecord] = {}
        free_slots: dict[str, bool] = {}
        for x, got in zip(ranked, listings, strict=True):
            if isinstance(got, BaseException):
                continue
            free_slots[x.replica_id] = await self._has_free_slot(x, got)  # type: ignore[index]
            for rec in got:
                if (rec.name, rec.version, rec.digest) == (name, v, ref.digest) and (
                    rec.state in _HAS_BYTES
                ):
                    has[x.replica_id] = rec  # type: ignore[index]
        sources = [x for x in ranked if x.replica_id in has]
        registered = self.sources.reference(name, v) if self.sources is not None else None
        if not sources and registered is None:
            raise AdapterCold(
                f"{name!r} v{v} is placed nowhere and no replica in rotation holds its bytes"
            )
        # Not the replicas that hold it already: the best-ranked one that has the bytes, then
        # the best-ranked ones that do not.
        free = [x for x in ranked if x.replica_id not in ref.replicas]
        if not free:
            return WarmResult(name=name, version=v, replicas=list(ref.replicas))
        # Among the best-ranked few (the hash keeps a name's replicas stable as the fleet
        # changes): one that needs no eviction first, then one that needs no copy, then the
        # least busy, then the hash's order.
        top = free[:RANKED]
        order = sorted(
            top,
            key=lambda x: (
                not free_slots.get(x.replica_id, False),  # type: ignore[arg-type]
                x.replica_id not in has,
                x.inflight,
                top.index(x),
            ),
        )
        why: list[str] = []
        for target in order:
            try:
                await self._load_on(target, name, v, ref.digest, has, sources, registered)
            except (NoRoom, InstallFailed, LorafleetError, TimeoutError) as exc:
                why.append(f"{target.replica_id}: {exc}")
                continue
            entry = self.store.aliases.get(name)
            holders = (
                []
                if entry is None
                else next((x.replicas for x in entry.window() if x.version == v), [])
            )
            return WarmResult(name=name, version=v, replicas=holders, loaded=target.replica_id)
        raise AdapterCold(f"{name!r} v{v} could not be loaded: " + "; ".join(why))

    async def _load_on(
        self,
        target: Replica,
        name: str,
        v: int,
        digest: str,
        has: dict[str, AdapterRecord],
        sources: list[Replica],
        registered: Reference | None = None,
    ) -> None:
        rid = target.replica_id
        assert rid is not None
        agent = self.client(target.agent_url)
        timeouts = InstallTimeouts(
            call_s=self.call_timeout_s, transfer_s=self.load_timeout_s, load_s=self.load_timeout_s
        )
        # An eviction of this very version from ``target`` may be under way (it was listed
        # there until a moment ago): let it finish, then look again. Once it is not listed
        # there, nothing evicts it from ``target`` until this load lists it.
        async with self._rooms.setdefault(target.agent_url, asyncio.Lock()):
            pass
        mine = has.get(rid)
        if mine is not None:
            records = await asyncio.wait_for(agent.list_adapters(), self.call_timeout_s)
            mine = next(
                (x for x in records if (x.name, x.version, x.digest) == (name, v, digest)), None
            )
        promise: list[_Promise] = []
        if mine is None or mine.state not in _HELD:
            _, promise = await self._room(target, 1, frozenset({name}))
        try:
            await self._install(target, agent, name, v, digest, mine, sources, timeouts, registered)
        finally:
            self._release(target.agent_url, promise)

    async def _install(
        self,
        target: Replica,
        agent: AsyncAgentClient,
        name: str,
        v: int,
        digest: str,
        mine: AdapterRecord | None,
        sources: list[Replica],
        timeouts: InstallTimeouts,
        registered: Reference | None = None,
    ) -> None:
        rid = target.replica_id
        assert rid is not None
        peer = next((x for x in sources if x is not target), None)
        if mine is None and peer is None and registered is not None:
            # Registered by reference: the agent copies the directory, checking each file
            # against the manifest the router read at registration.
            install = await ReplicaInstall.registered(
                agent, registered.manifest, registered.path, timeouts
            )
            canary = None
        elif mine is None:
            if peer is None:
                raise InstallFailed("no other replica in rotation holds its bytes")
            src = self.client(peer.agent_url)
            canary = await asyncio.wait_for(src.canary(name, v), self.call_timeout_s)
            install = await ReplicaInstall.copied_from_peer(
                agent, src, target.agent_url, name, v, timeouts, digest
            )
        else:
            install = ReplicaInstall(agent, name, v, None, timeouts)
            canary = await asyncio.wait_for(agent.canary(name, v), self.call_timeout_s)
            if mine.state not in _HELD:
                await install.load()
        rec = await install.prove(canary)
        if rec.digest != digest:
            raise InstallFailed(f"it verified other bytes ({rec.digest[:12]})")
        entry = self.store.aliases.get(name)
        if entry is not None and entry.version == v and self.store.lease_of(name) is None:
            await install.activate()
        self._placed_at[(name, v)] = time.monotonic()
        if not self.store.add_holder(name, v, digest, rid, rec.canary):
            raise InstallFailed(f"v{v} is no longer routable with digest {digest[:12]}")
        self._placed_at[(name, v)] = time.monotonic()
        self._on_demand.setdefault((name, v), set()).add(rid)
        self._changed()
        await self.copies.wait_acked(self.copies.seq)
        log.info("loaded %s v%d on %s on demand", name, v, rid)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
