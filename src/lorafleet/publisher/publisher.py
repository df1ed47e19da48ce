"""The Publisher: one publication as a transaction over every replica.

``atomic`` (the default with a router): stage and load version v on every replica under its
immutable engine name, flip the router's alias in one step, drain v-1, then release it. If any
replica fails before the flip, v is removed from every replica that took it, staging is discarded
everywhere, v-1 keeps serving, and one ``PublishError`` names each failing replica.

``in_place``: load under the plain name with upsert semantics on every replica. If any replica
fails, the name is unloaded on every reachable replica and staging is discarded (the SkyRL seed's
fail-closed contract).

This module holds the public API, the long-lived agent connections, the router lease and the
choice of version; each call's transaction is a fresh ``Publication`` (``_transaction.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from anyio.from_thread import start_blocking_portal

from lorafleet._http import async_client
from lorafleet.bundle import AdapterBundle
from lorafleet.clients.agent import AsyncAgentClient
from lorafleet.clients.router import AsyncRouterClient
from lorafleet.errors import (
    LorafleetError,
    PublishError,
    RemoteError,
    TransportError,
    VersionConflict,
)
from lorafleet.protocol.agent import MAX_FANOUT, AdapterRecord, AdapterState
from lorafleet.protocol.canary import Canary
from lorafleet.protocol.names import check_name
from lorafleet.protocol.placement import rendezvous
from lorafleet.protocol.relay import RelayMeasure, RelayRates
from lorafleet.protocol.router import LagState, ReplicaList, SessionPolicy
from lorafleet.publisher._errors import publish_error_class, reason
from lorafleet.publisher._lease import Lease
from lorafleet.publisher._plan import Mode, Plan, ProgressCallback, Transfer
from lorafleet.publisher._replica import Agent
from lorafleet.publisher._transaction import Publication, to_the_end
from lorafleet.publisher.carrier import Carrier, relay
from lorafleet.publisher.result import PublishResult, Retirement, StepClock, Timeouts

__all__ = ["AsyncPublisher", "ProgressCallback", "Publisher"]

T = TypeVar("T")

log = logging.getLogger("lorafleet.publisher")


class AsyncPublisher:
    """The asyncio Publisher. ``Publisher`` is its synchronous twin.

    Concurrent ``apublish`` calls on one Publisher: calls for different names are independent
    transactions and run at once. Calls for the same name wait for each other and run one after
    another, in the order they were made, exactly as if made in sequence: ``version=None`` gives
    each the next version, and an explicit version that the call before has taken is refused
    with ``VersionConflict``. (The router's lease cannot keep them apart: they share this
    Publisher's holder.) Publishers of one name in other processes are kept apart by that lease:
    the loser gets ``PublishInProgress``.
    """

    def __init__(
        self,
        agents: Sequence[str],
        router: str | None = None,
        token: str | None = None,
        *,
        router_token: str | None = None,
        timeouts: Timeouts | None = None,
        shared_dir: str | os.PathLike | None = None,
        holder: str | None = None,
        on_progress: ProgressCallback | None = None,
        verify: bool = True,
        relay_fanout: int | None = None,
        relay_stall_s: float = 10.0,
        relay_rates: RelayRates | None = None,
        carriers: Mapping[str, Carrier] | None = None,
        retire_in_background: bool = True,
    ) -> None:
        """Raises ``ValueError`` without agents. Connects to nothing until the first call.

        ``retire_in_background`` (default): ``publish()`` returns once v serves (the alias
        flip, which also gives the name's lease back); v is recorded active and the versions
        that left the window are drained and released after, in a task. The next publication of
        the name by this Publisher waits for that (as it waits for the one before it), and
        ``close()`` waits for it, so nothing changes for the fleet, only when the call returns
        (an async RL loop gets its step back ~30 ms sooner: bench/RESULTS.md); the outcome is
        logged, added to the next result's ``warnings`` where it fell short, and returned by
        ``retirements()``. ``retired_versions`` is then empty. Another Publisher may publish
        the name meanwhile: each retirement touches only versions older than its own that left
        the window, and an agent never lets an older activation demote a newer one. False:
        ``publish()`` returns once the retirement is done, with ``retired_versions``.

        ``verify``: before the cutover, each agent checks that its engine applies the new
        version, asked the way the router will ask (``AdapterNotApplied`` fails the replica).

        ``relay_fanout``, ``relay_stall_s``, ``relay_rates``: the relay transfer's tree (each
        agent forwards a file to this many others; 1 is a chain; None, the default, plans it
        for each file from the number of replicas and ``relay_rates``, which the Publisher
        learns from every tree it sends down when none are given: docs/transfer.md) and
        how long a hop may move no byte before it is dropped and its subtree re-parented. Agents
        reach each other at the URLs given here, so these must be reachable from the agents
        too.

        ``carriers``: more transfers by name (``lorafleet.publisher.carrier``), e.g. Ray's
        ``object_store``; ``transfer=<name>`` picks one.
        """
        if not agents:
            raise ValueError("a Publisher needs at least one agent URL")
        if relay_fanout is not None and not 1 <= relay_fanout <= MAX_FANOUT:
            raise ValueError(f"relay_fanout is between 1 and {MAX_FANOUT}, or None (planned)")
        if not 0 < relay_stall_s <= 600:
            raise ValueError("relay_stall_s is a positive number of seconds, at most 600")
        self.relay_fanout = relay_fanout
        self.relay_stall_s = relay_stall_s
        self.relay_rates = relay_rates or RelayRates()
        self.learn_relay_rates = relay_rates is None
        """Rates not given: each relayed file's tree refines them (``RelayRates.learned``)."""
        self.carriers: dict[str, Carrier] = {"relay": relay, **(carriers or {})}
        self.timeouts = timeouts or Timeouts()
        self.shared_dir = Path(shared_dir) if shared_dir else None
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.on_progress = on_progress
        self.verify = verify
        self._http = async_client(
            timeout=httpx.Timeout(self.timeouts.load, connect=self.timeouts.connect),
            limits=httpx.Limits(max_keepalive_connections=64, max_connections=256),
        )
        self._agents = [
            Agent(url=u.rstrip("/"), client=AsyncAgentClient(u, token, client=self._http))
            for u in agents
        ]
        self.router = (
            AsyncRouterClient(router, router_token or token, client=self._http) if router else None
        )
        # One lock per name: a publication of a name waits for the one before it (see above).
        self._name_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.retire_in_background = retire_in_background
        self._retiring: set[asyncio.Task[Retirement]] = set()
        self._retired: list[Retirement] = []
        """Background retirements done and not yet returned by ``retirements()``."""
        self._shortfalls: dict[str, list[str]] = {}
        """name -> what its last background retirement could not do (the next result's)."""

    def default_transfer(self) -> str:
        """``relay`` when the agents are on two or more hosts, else ``remote_upload``.

        Chosen by measurement (bench/relay.py, bench/RESULTS.md): across hosts the relay sends
        one copy where the star sends one per agent (4 replicas on 400 Mbit/s links: 1.45x one
        replica's time against 3.54x); on one host the copies cross no network and forwarding
        only costs the agents CPU (loopback: relay 0.99-1.08x the star's time).
        """
        hosts = {_host(a.url) for a in self._agents}
        return "relay" if len(hosts) > 1 else "remote_upload"

    async def aclose(self) -> None:
        """Wait for the retirements in the background, then close the connections. Not while
        a publication runs."""
        await self.retirements()
        await self._http.aclose()

    async def retirements(self) -> list[Retirement]:
        """Wait for every retirement running in the background; return those finished since
        the last call (oldest first)."""
        while self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
        done, self._retired = self._retired, []
        return done

    async def __aenter__(self) -> AsyncPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def apublish(
        self,
        source: Any,
        *,
        name: str,
        version: int | None = None,
        mode: Mode | None = None,
        transfer: Transfer | None = None,
        config: Mapping[str, Any] | Any | None = None,
        base_model: str | None = None,
        max_rank: int | None = None,
        keep_versions: int = 1,
        max_staleness: int | None = None,
        sessions: SessionPolicy = "pin",
        min_replicas: int | float | None = None,
        canary: Canary | None = None,
        max_replicas: int | None = None,
    ) -> PublishResult:
        """Publish ``source`` as ``name`` on every replica. See the module docstring.

        ``max_replicas`` (needs a router): publish to at most that many replicas, the name's
        placement set, chosen by rendezvous hashing of the name over the replicas that are up
        (the same set for every version of the name while the fleet does not change); the
        router routes the name there, catch-up feeds only those, and a request sent while none
        holds it loads it on demand (docs/placement.md). ``min_replicas`` then counts within
        the set. None: every replica.

        ``canary`` (``lorafleet.publisher.canary.compute_canary`` on the trainer's model):
        each replica's engine must also answer it as the trainer did before the flip
        (``lorafleet.protocol.canary``: the rule, and why it is relative); a replica that does
        not fails the publication (``CanaryMismatch``, with the figures) or, under a quorum, is
        left lagging. The verdicts are in ``PublishResult.replicas[*].canary``. None: the
        application probe alone (the engine does not answer as the base model).

        ``min_replicas`` (a count, or a fraction of the replicas in (0, 1]; needs a router):
        succeed once that many replicas hold the new version verified, loaded and proven. The
        others are lagging (``PublishResult.lagging``): routed none of it until the router has
        caught them up from a peer, and skipped by later quorum publications (with backoff)
        meanwhile. Below it, the publication rolls back as without one. None (the default):
        every replica, and a replica that the router sees down or whose agent does not answer
        its first call within ``Timeouts.answer`` fails the publication at once, by name.
        See docs/quorum.md.

        ``keep_versions`` (atomic mode): the retention window. The new version and the newest
        ``keep_versions - 1`` before it stay loaded and routable (``name@vN``; sessions keep
        the version they started on unless ``sessions="follow"``); an older one is drained and
        released once it leaves the window. ``max_staleness`` (default ``keep_versions - 1``)
        refuses pins and sessions further behind the newest. Each replica must hold
        ``keep_versions + 1`` versions of the name during a publication, beside its other
        adapters: one that cannot is refused, by name, before any byte moves.

        ``transfer``: how the bytes move. ``relay``: each file leaves here once and the agents
        forward it to each other while it streams in, each verifying its own copy
        (``_relay.py``); ``remote_upload``: one copy from here to each agent;
        ``shared_filesystem``: written once under ``shared_dir`` for the agents to read; or a
        carrier's name. None: ``default_transfer()`` (relay when the agents span hosts).

        ``source``: an ``AdapterBundle``, a PEFT directory, a ``PeftModel`` (serialized in memory)
        or a LoRA state dict with ``config=`` (a native-only checkpoint: a PEFT config dict, as
        ``peft_config["default"].to_dict()`` gives it, enums and sets included, or a
        ``peft.LoraConfig``). ``version=None`` takes
        the next version after the active one.

        Raises ``VersionConflict`` for a version that is not newer than the active one,
        ``PublishInProgress`` if another publisher holds the name, ``PublishError`` (with
        ``failures``: replica → reason) if any replica fails; ``AdapterInvalid`` before any byte
        is sent if the bundle is invalid; ``ValueError`` for a mode or transfer that this
        Publisher cannot do.
        """
        t_start = time.perf_counter()
        check_name(name)  # InvalidName (a ValueError) before anything else
        mode = mode or ("atomic" if self.router else "in_place")
        if mode == "atomic" and self.router is None:
            raise ValueError("atomic mode needs a router (the alias flip is the atomic step)")
        if keep_versions < 1 or (keep_versions > 1 and mode != "atomic"):
            raise ValueError("keep_versions is a positive count, above 1 only in atomic mode")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness cannot be negative")
        if transfer is None:
            transfer = self.default_transfer()
        if transfer not in ("remote_upload", "shared_filesystem", *self.carriers):
            raise ValueError(f"unknown transfer mode {transfer!r}")
        if transfer == "shared_filesystem" and self.shared_dir is None:
            raise ValueError("shared_filesystem transfer needs Publisher(shared_dir=...)")
        quorum = self._quorum(min_replicas, mode)
        if max_replicas is not None:
            if self.router is None or max_replicas < 1:
                raise ValueError("max_replicas is a positive count, and needs a router")
            if quorum is not None and quorum > max_replicas:
                raise ValueError(f"min_replicas {quorum} is over max_replicas {max_replicas}")

        clock = StepClock()
        # Cheap and local first: build (hash once) and validate before any byte leaves.
        with clock.step("build"):
            bundle = AdapterBundle.from_any(
                source, name=name, version=version or 1, config=config, base_model=base_model
            )
        build_s = clock.steps["build"]
        # Engine limits (rank, slots) differ per replica; each agent enforces its own, so that
        # a refusal names the replica. Here: everything that no engine would accept.
        with clock.step("build"):
            bundle.validate(max_rank=max_rank).raise_for_problems(f"adapter {name!r}")

        lock = self._name_locks[name]
        with clock.step("name_lock"):
            await lock.acquire()
        handed_off = False  # the lock and the lease went to a retirement in the background
        try:
            async with contextlib.AsyncExitStack() as stack:
                with clock.step("begin"):
                    begun = await self._begin(name, version, fail=quorum is None)
                lease = None
                if self.router is not None:
                    lease = await stack.enter_async_context(self._lease_held(name, clock))
                attempt = _Attempt()
                try:
                    if begun.unreachable and quorum is None:
                        raise PublishError(
                            "some agents are unreachable; nothing was published",
                            dict(begun.unreachable),
                        )
                    result = await self._run(
                        attempt, bundle, name, begun.version, begun.previous, begun.window,
                        begun.lag, begun.unreachable, quorum, mode=mode, transfer=transfer,
                        keep_versions=keep_versions, max_staleness=max_staleness,
                        sessions=sessions, t_start=t_start, build_s=build_s, canary=canary,
                        max_replicas=max_replicas, clock=clock, begun=begun, lease=lease,
                    )  # fmt: skip
                except BaseException:
                    if self.router is not None and not attempt.burnt:
                        # Nothing of this attempt was ever routable, and every agent that may
                        # hold its bytes knows it does: its number goes to the next one.
                        with contextlib.suppress(LorafleetError, asyncio.CancelledError):
                            await to_the_end(
                                self.router.release_version(name, self.holder, begun.version)
                            )
                    raise
                publication = attempt.publication
                if publication is not None and publication.retire_pending:
                    self._retire_later(publication, stack.pop_all(), lock)
                    handed_off = True
        finally:
            if not handed_off:
                lock.release()
        # What the last retirement of this name in the background could not do.
        result.warnings[:0] = self._shortfalls.pop(name, [])
        result.steps = dict(clock.steps)
        result.duration_s = time.perf_counter() - t_start
        return result

    def _retire_later(
        self, publication: Publication, lease: contextlib.AsyncExitStack, lock: asyncio.Lock
    ) -> None:
        """Retire ``publication`` in a task that then gives back the lease and the name's lock."""

        async def retire() -> Retirement:
            out = Retirement(name=publication.plan.name, version=publication.plan.version)
            try:
                out = await publication.finish()
            except BaseException as exc:
                out.error = reason(exc)
                if not isinstance(exc, Exception):
                    raise
            finally:
                try:
                    with contextlib.suppress(LorafleetError, asyncio.CancelledError):
                        await to_the_end(lease.aclose())
                finally:
                    lock.release()
                    self._retired_one(out)
            return out

        task = asyncio.create_task(retire(), name=f"lorafleet-retire-{publication.plan.name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _retired_one(self, out: Retirement) -> None:
        self._retired.append(out)
        problems = [*out.warnings, *([f"it stopped: {out.error}"] if out.error else [])]
        if problems:
            log.warning("retirement after %r v%d: %s", out.name, out.version, "; ".join(problems))
            self._shortfalls.setdefault(out.name, []).extend(
                f"retirement after v{out.version}: {p}" for p in problems
            )
        else:
            log.debug(
                "retired %s after %r v%d in %.1f ms",
                out.retired_versions, out.name, out.version, out.duration_s * 1e3,
            )  # fmt: skip

    async def _run(
        self,
        attempt: _Attempt,
        bundle: AdapterBundle,
        name: str,
        version: int,
        previous: int | None,
        window: tuple[int, ...],
        lag: Mapping[str, LagState],
        unreachable: Mapping[str, str],
        quorum: int | None,
        *,
        mode: Mode,
        transfer: Transfer,
        keep_versions: int,
        max_staleness: int | None,
        sessions: SessionPolicy,
        t_start: float,
        build_s: float,
        canary: Canary | None = None,
        max_replicas: int | None = None,
        clock: StepClock | None = None,
        begun: _Begun | None = None,
        lease: Lease | None = None,
    ) -> PublishResult:
        """The publication proper, under the lease, with its version number taken. ``begun``:
        what ``_begin`` read already (the router's view of the replicas, the adapter lists);
        ``lease``: the lease it holds, which its flip gives back."""
        clock = clock or StepClock()
        skipped: dict[str, str] = {}
        if quorum is not None:
            # Lagging and in its backoff: skipped without a call (a dead node costs nothing).
            now = time.time()
            for a in self._agents:
                st = lag.get(a.id)
                if st is not None and st.retry_at > now:
                    skipped[a.id] = (
                        f"lagging since v{st.since_version} ({st.reason}); skipped "
                        f"until {st.retry_at - now:.0f}s from now, or until caught up"
                    )
        with clock.step("down"):
            down = await self._down(
                unreachable, skip=set(skipped), seen=begun.seen if begun else None
            )
        if quorum is None and down:
            raise PublishError(
                f"cannot publish {name!r} v{version}: some replicas are down; nothing "
                "was sent (pass min_replicas to publish to a quorum)",
                down,
            )
        skipped.update(down)
        if quorum is not None and len(self._agents) - len(skipped) < quorum:
            raise PublishError(
                f"cannot publish {name!r} v{version}: {quorum} of {len(self._agents)} "
                f"replicas needed, {len(skipped)} are down or lagging; nothing was sent",
                skipped,
            )
        agents = [a for a in self._agents if a.id not in skipped and a.id not in unreachable]
        placement = None
        if max_replicas is not None:
            placement = rendezvous(name, [a.id for a in agents])[:max_replicas]
            agents = [a for a in agents if a.id in placement]
        with clock.step("room"):
            await self._check_room(
                name, keep_versions, agents, lists=begun.lists if begun else None
            )
        if bundle.version != version:
            bundle = bundle.with_version(version)
        measured: list[RelayMeasure] = []
        plan = Plan(
            bundle,
            mode,
            transfer,
            previous,
            self.shared_dir,
            # Holding the lease, a version above the active one is ours to take: what a
            # failed publication left of it on an agent is superseded, not a conflict.
            supersede=self.router is not None,
            verify=self.verify,
            keep_versions=keep_versions,
            max_staleness=max_staleness,
            sessions=sessions,
            previous_window=window,
            relay_fanout=self.relay_fanout,
            relay_stall_s=self.relay_stall_s,
            relay_rates=self.relay_rates,
            on_relay_measure=measured.append,
            quorum=quorum,
            canary=canary,
            placement=placement,
        )
        publication = Publication(
            plan,
            agents,
            router=self.router,
            holder=self.holder,
            timeouts=self.timeouts,
            on_progress=self.on_progress,
            carrier=self.carriers.get(transfer),
            skipped=skipped,
            lag_history=lag,
            clock=clock,
            lease=lease,
        )
        attempt.publication = publication
        try:
            result = await publication.run(
                t_start=t_start, build_s=build_s, retire_later=self.retire_in_background
            )
        finally:
            attempt.burnt = publication.burns
            if self.learn_relay_rates:
                for m in measured:
                    self.relay_rates = self.relay_rates.learned(m)
        result.relay_measured = measured
        return result

    # -- the lease and the version --------------------------------------------------------------
    async def _begin(self, name: str, version: int | None, *, fail: bool) -> _Begun:
        """What a publication reads before it plans, at once (one round trip's time): the
        agents learnt and answering (``_discover``), the router's lease with the version number
        and the active alias (one call, one durable write), the router's view of the replicas
        and each agent's adapters (for ``_check_room``).

        Raises what the router refused (``PublishInProgress``, ``VersionConflict``, or
        ``PublishError`` when it cannot be reached): nothing is held then; with ``fail``,
        the ``PublishError`` naming the agents that do not answer comes first. Otherwise an
        agent that does not answer is in ``unreachable``: the caller decides, under the lease.
        """
        reserving = asyncio.ensure_future(self._reserve(name, version))
        try:
            unreachable, lists = await self._discover()
            try:
                previous, window, lag, number, seen = await reserving
            except Exception:
                if fail and unreachable:  # the agents' failure names the replicas: first
                    raise PublishError(
                        "some agents are unreachable; nothing was published", unreachable
                    ) from None
                raise
        except BaseException:
            # Cancelled (or a bug): a reservation granted meanwhile is given back.
            with contextlib.suppress(BaseException):
                await to_the_end(self._unreserve(name, reserving))
            raise
        return _Begun(
            version=number,
            previous=previous,
            window=window,
            lag=lag,
            unreachable=unreachable,
            seen=seen,
            lists=lists,
        )

    async def _unreserve(self, name: str, reserving: asyncio.Future) -> None:
        """Give back what ``reserving`` was granted, if anything: the number and the lease."""
        # Bounded: a router that does not answer must not hold up a Ctrl-C (its lease, if it
        # was granted, then runs out).
        await asyncio.wait([reserving], timeout=self.timeouts.answer)
        if not reserving.done():
            reserving.cancel()
        if self.router is None or not reserving.done() or reserving.cancelled():
            return
        if reserving.exception() is not None:
            return
        number = reserving.result()[3]
        with contextlib.suppress(LorafleetError):
            await self.router.release_version(name, self.holder, number)
        with contextlib.suppress(LorafleetError):
            await self.router.release_lease(name, self.holder)

    async def _reserve(
        self, name: str, version: int | None
    ) -> tuple[int | None, tuple[int, ...], dict[str, LagState], int, ReplicaList | None]:
        """(the active version, its window newest first, its lagging replicas, the version to
        publish, the router's view of the replicas). With a router: one call takes the lease
        and the number and reads the alias and the replicas (``_choose_version`` says which
        number). Raises as ``_begin`` says."""
        if self.router is None:
            previous, window, lag = await self._active(name)
            number = await self._choose_version(name, version, previous)
            return previous, window, lag, number, None
        try:
            got = await self.router.begin(
                name, self.holder, version, lease_ttl_s=self.timeouts.lease_ttl
            )
        except VersionConflict:
            raise  # the number asked for is taken: as the router says
        except RemoteError as exc:
            cls = publish_error_class(exc) or PublishError
            raise cls(
                f"cannot publish {name!r}: the router refused the lease ({exc.message}); "
                "nothing was sent",
                {"router": exc.message},
            ) from exc
        except TransportError as exc:  # a PublishError like any other failed publication
            raise PublishError(
                f"cannot publish {name!r}: the router is unreachable; nothing was sent",
                {"router": str(exc)},
            ) from exc
        seen = None if got.replicas is None else ReplicaList(replicas=got.replicas)
        entry = got.entry
        if entry is None:
            return None, (), {}, got.version, seen
        window = tuple(v.version for v in entry.window())
        return entry.version, window, dict(entry.lagging), got.version, seen

    @contextlib.asynccontextmanager
    async def _lease_held(self, name: str, clock: StepClock) -> AsyncIterator[Lease]:
        """Keep the lease ``_begin`` took on ``name`` while the body runs (renewed), then give
        it back, unless the flip gave it back already."""
        assert self.router is not None
        lease = Lease(self.router, name, self.holder, self.timeouts.lease_ttl)
        try:
            yield lease
        finally:
            with (
                clock.step("lease_release"),
                contextlib.suppress(LorafleetError, asyncio.CancelledError),
            ):
                await to_the_end(lease.end())

    async def _active(self, name: str) -> tuple[int | None, tuple[int, ...], dict[str, LagState]]:
        """(the active version, the routable versions newest first, the lagging replicas) of
        ``name``."""
        if self.router is not None:
            table = await self.router.table(log=False)
            entry = table.aliases.get(name)
            if entry is None:
                return None, (), {}
            return entry.version, tuple(v.version for v in entry.window()), dict(entry.lagging)
        lists = await asyncio.gather(*(a.client.list_adapters() for a in self._agents))
        versions = [r.version for lst in lists for r in lst if r.name == name]
        return (max(versions), (max(versions),), {}) if versions else (None, (), {})

    async def _check_room(
        self,
        name: str,
        keep_versions: int,
        agents: Sequence[Agent],
        lists: Mapping[str, list[AdapterRecord] | BaseException] | None = None,
    ) -> None:
        """Before any byte moves, room on every replica's engine for this publication.

        A retention the engine can never hold (``keep_versions + 1`` slots: the window, and the
        new version while the oldest drains) is refused. Otherwise the slots needed now are the
        versions of this name held there (up to ``keep_versions``) plus the new one; where other
        names fill the rest, the router evicts the least recently used of them, drained first
        (``docs/placement.md``). Raises ``PublishError`` naming each replica that has no room.
        """
        capped = [a for a in agents if a.info and a.info.capabilities.max_adapters]
        if lists is None or any(a.url not in lists for a in capped):
            got = await asyncio.gather(
                *(a.client.list_adapters() for a in capped), return_exceptions=True
            )
            lists = {a.url: out for a, out in zip(capped, got, strict=True)}
        short: dict[str, str] = {}
        for agent in capped:
            records = lists[agent.url]
            if isinstance(records, BaseException):
                continue  # unreachable now: its own load check refuses what it cannot hold
            cap = agent.info.capabilities.max_adapters  # type: ignore[union-attr]
            if keep_versions + 1 > cap:
                short[agent.id] = (
                    f"its engine holds at most {cap} adapters: {keep_versions} version(s) of "
                    f"{name!r} and the one being published need {keep_versions + 1}"
                )
                continue
            held = [r for r in records if r.state in (AdapterState.LOADED, AdapterState.ACTIVE)]
            others = {r.engine_name for r in held if r.name != name}
            mine = min(keep_versions, len({r.version for r in held if r.name == name}))
            over = len(others) + mine + 1 - cap
            if over <= 0:
                continue
            why = (
                f"its engine holds at most {cap} adapters: {len(others)} of other names plus "
                f"{mine} version(s) of {name!r} and the one being published need "
                f"{len(others) + mine + 1}"
            )
            if self.router is None:
                short[agent.id] = why
                continue
            try:
                await self.router.make_room(agent.id, over, keep=[name])
            except LorafleetError as exc:
                short[agent.id] = f"{why}, and the router could not make room: {exc}"
        if short:
            raise PublishError(
                f"cannot keep {keep_versions} version(s) of {name!r}: some replicas have no room; "
                "nothing was published",
                short,
            )

    async def _choose_version(self, name: str, version: int | None, previous: int | None) -> int:
        """The version to publish: the one asked for, or the next one. With a router, the number
        is reserved there: above the active version and every number handed out before, across
        failures and restarts (a failed attempt's number is burnt unless given back; see
        ``Publication.burns``). Raises ``VersionConflict`` if the one asked for is not newer."""
        if previous is not None and version is not None and version <= previous:
            raise VersionConflict(
                f"version {version} of {name!r} is not newer than the active version {previous}"
            )
        if self.router is not None:
            return await self.router.reserve(name, self.holder, version)
        return (previous or 0) + 1 if version is None else version

    @staticmethod
    def _quorum_of(min_replicas: int | float | None, n: int) -> int | None:
        """``min_replicas`` as a count of the ``n`` replicas (None: all, the atomic default).
        Raises ``ValueError`` for a count outside 1..n or a fraction outside (0, 1]."""
        if min_replicas is None:
            return None
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int | float):
            raise ValueError("min_replicas is a count (int) or a fraction (float) of the replicas")
        if isinstance(min_replicas, float):
            if not 0 < min_replicas <= 1:
                raise ValueError("min_replicas as a fraction is in (0, 1]")
            count = math.ceil(min_replicas * n - 1e-9)
        else:
            count = min_replicas
        if not 1 <= count <= n:
            raise ValueError(f"min_replicas is between 1 and the {n} replicas")
        return None if count == n else count

    def _quorum(self, min_replicas: int | float | None, mode: Mode) -> int | None:
        q = self._quorum_of(min_replicas, len(self._agents))
        if q is not None and (self.router is None or mode != "atomic"):
            raise ValueError("min_replicas needs atomic mode and a router (it routes by holder)")
        return q

    async def _discover(
        self,
    ) -> tuple[dict[str, str], dict[str, list[AdapterRecord] | BaseException]]:
        """Learn each agent once and see that it answers now, each within ``Timeouts.answer``,
        by listing its adapters (what ``_check_room`` reads). Returns (the agents that did not
        answer: id -> why, each agent's adapters by URL, or the refusal it answered with)."""
        bound = self.timeouts.answer

        lists: dict[str, list[AdapterRecord] | BaseException] = {}

        async def reach(a: Agent) -> None:
            await asyncio.wait_for(a.discover(), bound)
            try:
                lists[a.url] = await asyncio.wait_for(a.client.list_adapters(), bound)
            except RemoteError as exc:
                lists[a.url] = exc  # it answers: what it refused shows at its own steps

        outcomes = await asyncio.gather(*(reach(a) for a in self._agents), return_exceptions=True)
        failures = {
            agent.id: (
                f"did not answer within {bound:g}s (Timeouts.answer)"
                if isinstance(out, TimeoutError)
                else reason(out)
            )
            for agent, out in zip(self._agents, outcomes, strict=True)
            if isinstance(out, BaseException)
        }
        return failures, lists

    async def _down(
        self,
        unreachable: Mapping[str, str],
        *,
        skip: set[str] | frozenset[str] = frozenset(),
        seen: ReplicaList | None = None,
    ) -> dict[str, str]:
        """``unreachable``, plus the replicas that the router sees out of rotation and whose
        agent says it is not ready now (its engine is down, or it is reinstalling adapters).
        ``seen``: the router's view, read already."""
        down = dict(unreachable)
        if self.router is None:
            return down
        if seen is None:
            try:
                seen = await asyncio.wait_for(self.router.replicas(), self.timeouts.answer)
            except (LorafleetError, TimeoutError):
                return down  # the router's own failure shows at the lease or the flip
        # An agent never reached is known here by its URL only: name it as the router does.
        ids = {r.agent_url.rstrip("/"): r.replica_id for r in seen.replicas}
        down = {ids.get(k, k): v for k, v in down.items()}
        out = {r.replica_id: r for r in seen.replicas if not r.healthy}
        bound = self.timeouts.answer

        async def check(a: Agent, detail: str | None) -> str | None:
            # An agent reinstalling adapters after an engine restart reaches its engine and can
            # take a load: only one whose engine stays unreachable for ``bound`` is down.
            deadline = time.monotonic() + bound
            why = f"the router sees it down ({detail}) and its agent is silent"
            while True:
                try:
                    h = await asyncio.wait_for(a.client.health(), bound)
                except (LorafleetError, TimeoutError):
                    return why
                if h.status == "ok" or h.engine_reachable:
                    return None
                why = f"the router sees it down and its engine is unreachable ({h.detail})"
                if time.monotonic() >= deadline:
                    return why
                await asyncio.sleep(0.2)

        suspects = [
            a for a in self._agents if a.id in out and a.id not in down and a.id not in skip
        ]
        verdicts = await asyncio.gather(*(check(a, out[a.id].detail) for a in suspects))
        for a, why in zip(suspects, verdicts, strict=True):
            if why is not None:
                down[a.id] = why
        return down


@dataclass
class _Attempt:
    burnt: bool = False
    """The attempt failed in a way that keeps its version number taken (``Publication.burns``)."""
    publication: Publication | None = None


@dataclass
class _Begun:
    """What ``AsyncPublisher._begin`` read: the plan's inputs, under the lease."""

    version: int
    previous: int | None
    window: tuple[int, ...]
    lag: dict[str, LagState]
    unreachable: dict[str, str]
    seen: ReplicaList | None
    """The router's view of the replicas (None: no router, or it did not answer)."""
    lists: dict[str, list[AdapterRecord] | BaseException]
    """agent URL -> its adapters, or why it could not list them."""


def _host(url: str) -> str:
    """The host of an agent URL, every loopback name counted as one host."""
    host = httpx.URL(url).host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return "loopback" if loopback else host


class Publisher:
    """The synchronous Publisher for trainer code: an ``AsyncPublisher`` on an anyio blocking
    portal (an event loop in a thread of its own). Safe to call from several threads at once;
    see ``AsyncPublisher`` for how concurrent publications behave.

    An interrupted ``publish`` (KeyboardInterrupt) cancels the publication and waits up to
    ``_rollback_wait_s`` for its rollback before re-raising; a second Ctrl-C stops the wait.

    ``Publisher(agents=[...], router=..., token=...).publish(model, name="policy")``.
    """

    def __init__(
        self,
        agents: Sequence[str],
        router: str | None = None,
        token: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Takes ``AsyncPublisher``'s arguments; raises what it raises."""
        self._rollback_wait_s = 60.0
        self._closed = False
        self._portal_cm = start_blocking_portal(name="lorafleet-publisher")
        self._portal = self._portal_cm.__enter__()
        try:
            # Made on the portal's loop, whose connections it keeps.
            self._async = self._portal.call(lambda: AsyncPublisher(agents, router, token, **kwargs))
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        if self._closed:
            raise RuntimeError("this Publisher is closed")
        finished = threading.Event()

        async def run() -> T:
            try:
                return await fn(*args, **kwargs)
            finally:
                finished.set()  # after the publication's own cleanup (its rollback) is done

        fut = self._portal.start_task_soon(run)
        try:
            return fut.result()
        except BaseException:
            # Ctrl-C in the trainer: cancelling the future cancels the task's scope on the
            # portal; the publication rolls back (shielded) before it ends. Wait for that, so
            # that nothing of a half-done publication stays on the replicas.
            if fut.cancel():
                finished.wait(self._rollback_wait_s)
            raise

    def publish(self, source: Any, *, name: str, **kwargs: Any) -> PublishResult:
        """Publish ``source`` as ``name``; see ``AsyncPublisher.apublish`` (it raises the same).
        Raises ``RuntimeError`` once closed."""
        return self._call(self._async.apublish, source, name=name, **kwargs)

    def retirements(self) -> list[Retirement]:
        """Wait for the retirements in the background; see ``AsyncPublisher.retirements``."""
        return self._call(self._async.retirements)

    def close(self) -> None:
        """Wait for the retirements in the background, release the connections and the
        portal's thread. Not while a publication runs."""
        if self._closed:
            return
        try:
            self._call(self._async.aclose)
        finally:
            self._closed = True
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
