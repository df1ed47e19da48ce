"""Adapter lifecycle on one replica: commit, register, load, activate, unload, list.

Every operation on one adapter name runs under that name's ``asyncio.Lock``; different names
proceed in parallel. Records are written to the state DB before the call returns, so the
reconciler (and a restarted agent) knows what the engine should hold.

States: ``staged`` (on disk, not in the engine), ``loaded`` (in the engine), ``active`` (loaded
and the name's current version), ``failed`` (the engine refused it; ``error`` says why),
``retiring`` (an unload the engine did not answer: finished, engine first and files second, as
soon as the engine answers again, by the next unload or by the reconciler).

Leftovers of a publication that failed while an engine or agent was down (a version staged or
loaded, never activated) never wedge the name: a publisher holding the name's lease opens the
next upload with ``supersede`` and they are retired first.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

from lorafleet.agent.backends import (
    AdapterMissing,
    EngineBackend,
    EngineRejected,
    EngineUnavailable,
)
from lorafleet.agent.metrics import Metrics
from lorafleet.agent.probe import ApplicationProbe
from lorafleet.agent.state import StateDB, StoredAdapter
from lorafleet.agent.store import Store
from lorafleet.agent.uploads import UploadManager
from lorafleet.bundle import config_rank, validate_adapter_dir
from lorafleet.bundle.delta import lora_delta_bound
from lorafleet.engine_kinds import engine_kind
from lorafleet.errors import (
    AdapterConflict,
    AdapterInvalid,
    AdapterNotApplied,
    AdapterNotFound,
    CanaryMismatch,
    IntegrityError,
    InvalidRequest,
    PathNotAllowed,
    QuotaExceeded,
    SizeMismatch,
    UploadIncomplete,
    VersionConflict,
)
from lorafleet.protocol.agent import (
    AdapterRecord,
    AdapterState,
    EngineCapabilities,
    LoadMode,
    RelayAccept,
    UploadSession,
    engine_name,
)
from lorafleet.protocol.canary import CANARY_TOP_K, Canary, CanaryVerdict, judge
from lorafleet.protocol.manifest import ADAPTER_CONFIG, Manifest

__all__ = ["AdapterService"]


# What a shared-filesystem path can make reading it fail with: the trainer's input, a 400.
_UNREADABLE = frozenset(
    {errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.ELOOP}
)


def _delta_bound(path: Path, config: dict) -> float | None:
    """The staged adapter's delta bound, or None when it cannot be read here."""
    weights = path / "adapter_model.safetensors"
    try:
        return lora_delta_bound(weights, config) if weights.is_file() else None
    except Exception:  # validation judges the file; an unknown bound only weakens the probe
        return None


_IN_ENGINE = (AdapterState.LOADED, AdapterState.ACTIVE)


class AdapterService:
    def __init__(
        self,
        store: Store,
        db: StateDB,
        uploads: UploadManager,
        backend: EngineBackend,
        caps: EngineCapabilities,
        metrics: Metrics,
        shared_fs_allow: list[str] | None = None,
    ) -> None:
        self.store = store
        self.db = db
        self.uploads = uploads
        self.backend = backend
        self.caps = caps
        self.metrics = metrics
        self.allow = [Path(p).resolve() for p in shared_fs_allow or []]
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._loading: set[str] = set()
        """Engine names whose load is under way (they count against the engine's slots)."""
        self.probe: ApplicationProbe | None = None
        """Set once the engine has been probed (its kind and base model are known)."""

    # --- checks ----------------------------------------------------------------------------

    def check_version(self, manifest: Manifest) -> None:
        """Refuse a version not newer than a loaded one, or one that clashes with a record.

        Only versions in the engine block older ones: after the Publisher unloads v (rollback),
        publishing v again works.
        """
        for item in self.db.by_name(manifest.name):
            r = item.record
            if r.version == manifest.version:
                if r.digest == manifest.digest:
                    continue  # the same bundle again: idempotent
                raise AdapterConflict(
                    f"{manifest.name!r} v{manifest.version} already exists with a different "
                    f"digest ({r.digest[:12]}); unload it first",
                )
            if r.state in _IN_ENGINE and r.version > manifest.version:
                raise VersionConflict(
                    f"{manifest.name!r} v{manifest.version} is not newer than loaded v{r.version}",
                )

    def _get(self, name: str, version: int) -> StoredAdapter:
        item = self.db.get(name, version)
        if item is None:
            raise AdapterNotFound(f"no adapter {name!r} v{version} on this replica")
        return item

    async def _clear_leftovers(self, manifest: Manifest, supersede: bool) -> None:
        """Retire what stands in the way of ``manifest`` before it is staged (under the lock).

        Always: records of this name being retired. With ``supersede``: never-activated,
        versioned records of this version (other bytes) or newer, which only a failed
        publication leaves, since a lease-holding publisher publishes above the active version.
        Raises ``EngineUnavailable`` when one at this very version cannot be removed yet.
        """
        for item in self.db.by_name(manifest.name):
            r = item.record
            leftover = (
                supersede
                and r.version >= manifest.version
                and r.state != AdapterState.ACTIVE
                and r.mode == "versioned"
                and not (r.version == manifest.version and r.digest == manifest.digest)
            )
            if r.state != AdapterState.RETIRING and not leftover:
                continue
            try:
                await self._retire(item)
            except EngineUnavailable:
                if r.version == manifest.version:
                    raise  # still in the way; the next attempt, once the engine is back, works

    # --- commit / register -----------------------------------------------------------------

    async def open_upload(
        self, manifest: Manifest, *, supersede: bool = False, relay: RelayAccept | None = None
    ) -> UploadSession:
        """Open an upload session (see ``UploadManager.open``) once leftovers are cleared."""
        async with self.locks[manifest.name]:
            await self._clear_leftovers(manifest, supersede)
            return self.uploads.open(manifest, self.check_version, relay, supersede=supersede)

    async def commit(self, upload_id: str) -> AdapterRecord:
        s = self.uploads.get(upload_id)
        m = s.manifest
        async with self.locks[m.name]:
            s = self.uploads.get(upload_id)
            pending = [f.entry.path for f in s.files.values() if not f.complete]
            lost = [f.path for f in m.files if not self.store.has_blob(f.sha256, f.size)]
            if pending or lost:
                raise UploadIncomplete(
                    f"upload {upload_id} is missing {sorted(set(pending + lost))}",
                )
            # The session ends here whatever happens; its blobs stay pinned until staging has
            # linked them (a discard of another session sharing them must not take them), and
            # on failure they go unless something else uses them.
            shas = {f.sha256 for f in m.files}
            try:
                with self.uploads.pinned(shas):
                    await self.uploads.aclose(upload_id, keep_blobs=True)
                    return await self._stage(m)
            except BaseException:
                self.uploads.gc_blobs(shas)
                raise

    async def register(
        self, manifest: Manifest, path: str, *, supersede: bool = False
    ) -> AdapterRecord:
        """Shared filesystem: verify ``path`` against ``manifest``, ingest into blobs, stage."""
        src = Path(path).resolve()
        if not self.allow or not any(src == a or a in src.parents for a in self.allow):
            raise PathNotAllowed(
                f"{path!r} (resolved {str(src)!r}) is outside the shared-filesystem allow-list",
            )
        async with self.locks[manifest.name]:
            await self._clear_leftovers(manifest, supersede)
            self.check_version(manifest)
            self.uploads.admit(manifest)
            # Pinned from here until staged: blobs found present must not be collected by a
            # concurrent unload or discard before the adapter directory links them.
            shas = {f.sha256 for f in manifest.files}
            try:
                with self.uploads.pinned(shas):
                    await self._ingest(manifest, src)
                    return await self._stage(manifest)
            except BaseException:
                self.uploads.gc_blobs(shas)
                raise

    async def _ingest(self, manifest: Manifest, src: Path) -> None:
        try:
            for f in manifest.files:
                file_src = src / f.path
                if not file_src.resolve().is_relative_to(src):
                    raise PathNotAllowed(f"{f.path!r} is a symlink out")
                await asyncio.to_thread(self.store.ingest_file, file_src, f.size, f.sha256)
        except FileNotFoundError as exc:
            raise InvalidRequest(f"missing file: {exc}") from None
        except OSError as exc:
            if exc.errno not in _UNREADABLE:
                raise
            why = f"cannot read {exc.filename}: {exc.strerror}"
            raise InvalidRequest(why, param="path") from None
        except IntegrityError as exc:
            kind = "size" if isinstance(exc, SizeMismatch) else "digest"
            self.metrics.verification_failures.labels(kind).inc()
            raise

    async def _stage(self, m: Manifest) -> AdapterRecord:
        """Assemble adapters/<name>/<version> from blobs, validate it, record it as staged."""
        existing = self.db.get(m.name, m.version)
        if existing is not None and existing.record.digest == m.digest:
            return existing.record
        self.check_version(m)
        files = {f.path: f.sha256 for f in m.files}
        # A native-only checkpoint has no adapter_config.json; engines read one from disk, so
        # write it from the manifest's config (promise 7).
        extra = {}
        if ADAPTER_CONFIG not in files:
            extra[ADAPTER_CONFIG] = json.dumps(m.config, indent=2, sort_keys=True).encode()
        path = await asyncio.to_thread(self.store.assemble, m.name, m.version, files, extra)
        # This engine kind's rules: what it refuses, and what it would serve wrong.
        report = await asyncio.to_thread(
            validate_adapter_dir,
            path,
            config=m.config,
            max_rank=self.caps.max_lora_rank,
            engine=self.caps.kind,
        )
        if not report.ok:
            await asyncio.to_thread(shutil.rmtree, path, True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()
            raise AdapterInvalid(
                report.problems, f"{m.name!r} v{m.version} is not a loadable adapter"
            )
        rec = AdapterRecord(
            name=m.name,
            version=m.version,
            digest=m.digest,
            engine_name=engine_name(m.name, m.version),
            mode="versioned",
            state=AdapterState.STAGED,
            path=str(path),
            delta_bound=await asyncio.to_thread(_delta_bound, path, m.config),
        )
        self.db.put(StoredAdapter(rec, m))
        await self._update_usage()
        return rec

    # --- engine operations -----------------------------------------------------------------

    async def load(self, name: str, version: int, mode: LoadMode) -> AdapterRecord:
        async with self.locks[name]:
            item = self._get(name, version)
            rec = item.record
            ename = engine_name(name, version, mode)
            if rec.state in _IN_ENGINE and rec.mode == mode:
                return rec  # idempotent
            if rec.state == AdapterState.RETIRING:
                raise AdapterConflict(f"{name!r} v{version} is being unloaded; publish it again")
            if rec.state in _IN_ENGINE:
                raise AdapterConflict(
                    f"{name!r} v{version} is loaded as {rec.mode}; unload it before loading "
                    f"as {mode}",
                )
            newer = [
                i.record.version for i in self.db.by_name(name) if i.record.state in _IN_ENGINE
            ]
            if mode == "in_place" and newer and max(newer) > version:
                raise VersionConflict(
                    f"{name!r} v{max(newer)} is loaded; v{version} may not replace it",
                )
            rank = config_rank(item.manifest.config)
            if rank is not None and self.caps.max_lora_rank and rank > self.caps.max_lora_rank:
                limit = self.caps.max_lora_rank
                raise AdapterInvalid(
                    [f"LoRA rank {rank} is over the engine's max_lora_rank {limit}"],
                    f"{name!r} v{version}",
                )
            # In place, the previous holder of the plain name gives its engine slot to us.
            holder = self._holder(ename)
            if self.caps.max_adapters is not None and holder is None:
                held = {i.record.engine_name for i in self.db.all() if i.record.state in _IN_ENGINE}
                # Loads of other names under way hold a slot too (each name has its own lock).
                held |= self._loading
                if len(held) >= self.caps.max_adapters:
                    raise QuotaExceeded(
                        f"the engine already holds {len(held)} adapters, its limit is "
                        f"{self.caps.max_adapters}; unload one before loading {ename!r}",
                    )
            self._loading.add(ename)
            try:
                t0 = time.perf_counter()
                path = rec.path
                linked = mode == "in_place" and engine_kind(self.caps.kind).links_in_place
                if linked:
                    # SGLang re-reads a name's remembered path after an unload: in place, the plain
                    # name is loaded from a link the agent points at the current version, so any
                    # such re-read gets these weights (docs/engines/sglang.md).
                    path = str(await asyncio.to_thread(self.store.point_link, name, version))
                # Recorded before the call: if its outcome is unknown (timeout, cancellation, crash)
                # the engine may hold ``ename`` from these files, and unload must ask it first.
                attempt = {"mode": mode, "engine_name": ename, "path": path}
                pending = rec.model_copy(
                    update={**attempt, "error": f"loading as {ename!r}: outcome unknown"}
                )
                self.db.put(StoredAdapter(pending, item.manifest))
                try:
                    await self.backend.load(ename, path, replace=holder is not None)
                except EngineRejected as exc:
                    rec = rec.model_copy(
                        update={**attempt, "state": AdapterState.FAILED, "error": str(exc)}
                    )
                    self.db.put(StoredAdapter(rec, item.manifest))
                    if linked and holder is not None:
                        # Back to the holder's files, which a re-read under the name must find.
                        await asyncio.to_thread(self.store.point_link, name, holder.record.version)
                    raise
                except EngineUnavailable as exc:
                    rec = pending.model_copy(
                        update={"error": f"loading as {ename!r}: outcome unknown: {exc}"}
                    )
                    self.db.put(StoredAdapter(rec, item.manifest))
                    raise
                self.metrics.load_seconds.observe(time.perf_counter() - t0)
                state = AdapterState.LOADED
                if holder is not None:
                    # The replaced version leaves the engine; its files may go when it is unloaded.
                    if holder.record.state == AdapterState.ACTIVE:
                        state = AdapterState.ACTIVE
                    old = holder.record.model_copy(
                        update={"state": AdapterState.STAGED, "error": None}
                    )
                    self.db.put(StoredAdapter(old, holder.manifest))
                rec = rec.model_copy(update={**attempt, "state": state, "error": None})
                self.db.put(StoredAdapter(rec, item.manifest))
                return rec
            finally:
                self._loading.discard(ename)

    def _holder(self, ename: str) -> StoredAdapter | None:
        for i in self.db.all():
            if i.record.engine_name == ename and i.record.state in _IN_ENGINE:
                return i
        return None

    async def verify(self, name: str, version: int, canary: Canary | None = None) -> AdapterRecord:
        """Check that the engine applies this loaded version, addressed as the router will,
        and (with ``canary``) that it answers the trainer's canary as the trainer did.

        Records the outcomes on the record. Raises ``AdapterNotApplied`` when the engine answers
        as the base model for a version whose delta should show, ``CanaryMismatch`` when its
        canary verdict is ``failed``, ``EngineUnavailable`` when the probe cannot run,
        ``AdapterConflict`` when the version is not in the engine.
        """
        async with self.locks[name]:
            item = self._get(name, version)
            if item.record.state not in _IN_ENGINE:
                raise AdapterConflict(
                    f"{name!r} v{version} is {item.record.state.value}; load it before verifying"
                )
            rec = await self.prove_locked(item, canary)
            if canary is not None:
                self.db.put_canary(name, version, canary)
            return rec

    async def prove_locked(self, item: StoredAdapter, canary: Canary | None) -> AdapterRecord:
        """``verify``'s proof of a version in the engine, its outcomes recorded; the caller
        holds the name's lock (the reconciler, after a reinstall). Raises as ``verify``."""
        if self.probe is None:
            raise EngineUnavailable("the engine has not been probed yet")
        rec = item.record
        name, version = rec.name, rec.version
        verdict = await self.probe.check(rec.engine_name, rec.delta_bound)
        self.metrics.application_checks.labels(verdict.outcome).inc()
        rec = rec.model_copy(update={"application": verdict.outcome})
        self.db.put(StoredAdapter(rec, item.manifest))
        if verdict.outcome == "not_applied":
            raise AdapterNotApplied(f"{name!r} v{version}: {verdict.detail}")
        if canary is not None:
            judged = await self._canary(rec.engine_name, canary)
            self.metrics.canary_checks.labels(judged.outcome).inc()
            rec = rec.model_copy(update={"canary": judged})
            self.db.put(StoredAdapter(rec, item.manifest))
            if judged.outcome == "failed":
                raise CanaryMismatch(f"{name!r} v{version}: {judged.detail}")
        return rec

    async def _canary(self, engine_name: str, canary: Canary) -> CanaryVerdict:
        assert self.probe is not None
        answers = [
            await self.backend.next_token_logprobs(
                self.probe.base_model, engine_name, p.prompt_ids, CANARY_TOP_K
            )
            for p in canary.prompts
        ]
        return judge(canary, answers, engine_kind(self.caps.kind).canary_tolerance)

    async def activate(self, name: str, version: int) -> AdapterRecord:
        """Record ``version`` as the name's active one here (the one older versions make way
        for). A newer active version stays so: versions only grow, and a publication's
        activation can land after the next one's (each retires after its flip, without the
        lease), so the older one is left as it is and returned."""
        async with self.locks[name]:
            item = self._get(name, version)
            if item.record.state not in _IN_ENGINE:
                raise AdapterConflict(
                    f"{name!r} v{version} is {item.record.state.value}; load it before activating",
                )
            if any(
                o.record.state == AdapterState.ACTIVE and o.record.version > version
                for o in self.db.by_name(name)
            ):
                return item.record
            for other in self.db.by_name(name):
                if other.record.state == AdapterState.ACTIVE and other.record.version != version:
                    r = other.record.model_copy(update={"state": AdapterState.LOADED})
                    self.db.put(StoredAdapter(r, other.manifest))
            rec = item.record.model_copy(update={"state": AdapterState.ACTIVE})
            self.db.put(StoredAdapter(rec, item.manifest))
            return rec

    async def unload(self, name: str, version: int) -> AdapterRecord:
        """Remove from the engine (if there), then the files: never the other way round.

        Raises ``EngineUnavailable`` when the engine does not answer; the record is then
        ``retiring`` and the agent finishes the unload once the engine answers (files stay
        until then; see ``retire_pending``).
        """
        async with self.locks[name]:
            return await self._retire(self._get(name, version))

    async def evict(self, name: str, version: int) -> AdapterRecord:
        """Take ``name`` v``version`` out of the engine and keep its verified files: the record
        is ``staged`` again, and a later load (the router's on-demand path) needs no bytes. The
        router calls this only once nothing routes the version here and its requests drained.

        Raises ``AdapterConflict`` for a version loaded in place (its plain name is not this
        version's alone), ``EngineUnavailable`` when the engine does not answer (nothing
        changes; the caller tries again or another victim)."""
        async with self.locks[name]:
            item = self._get(name, version)
            rec = item.record
            if rec.state not in _IN_ENGINE:
                return rec  # idempotent: not in the engine
            if rec.mode == "in_place":
                raise AdapterConflict(
                    f"{name!r} v{version} is loaded in place; only a versioned name is evicted"
                )
            with contextlib.suppress(AdapterMissing):
                await self.backend.unload(rec.engine_name)
            staged = rec.model_copy(update={"state": AdapterState.STAGED, "error": None})
            self.db.put(StoredAdapter(staged, item.manifest))
            self.metrics.evictions.inc()
            return staged

    async def retire_pending(self) -> int:
        """Finish the unloads the engine did not answer (the reconciler calls this); how many
        records are gone now."""
        done = 0
        for item in self.db.all():
            if item.record.state != AdapterState.RETIRING:
                continue
            async with self.locks[item.record.name]:
                cur = self.db.get(item.record.name, item.record.version)
                if cur is not None and cur.record.state == AdapterState.RETIRING:
                    with contextlib.suppress(EngineUnavailable):
                        await self._retire(cur)
                        done += 1
        return done

    async def _retire(self, item: StoredAdapter) -> AdapterRecord:
        """Engine first, then the record and the files (caller holds the name's lock)."""
        rec = item.record
        try:
            for ename in self._engine_names(item):
                # Already gone (engine restarted, or never got there) is fine.
                with contextlib.suppress(AdapterMissing):
                    await self.backend.unload(ename)
        except EngineUnavailable as exc:
            # The engine may still hold the files (promise 6): keep them, and keep the wish.
            retiring = rec.model_copy(
                update={"state": AdapterState.RETIRING, "error": f"unload pending: {exc}"}
            )
            self.db.put(StoredAdapter(retiring, item.manifest))
            raise EngineUnavailable(
                f"{exc}; {rec.engine_name!r} stays until the engine answers, then this agent "
                "unloads it and removes its files"
            ) from exc
        self.db.delete(rec.name, rec.version)
        if rec.mode == "in_place" and self._holder(rec.name) is None:
            # Nothing holds the plain name now: a later re-read by the engine must find nothing.
            await asyncio.to_thread(self.store.remove_link, rec.name)
        shas = item.shas
        await asyncio.to_thread(self.store.remove_adapter_dir, rec.name, rec.version, [])
        self.uploads.gc_blobs(shas)
        await self._update_usage()
        return rec.model_copy(update={"state": AdapterState.STAGED})

    def _engine_names(self, item: StoredAdapter) -> list[str]:
        """Engine names that may hold this version's files, to unload before deleting them.

        A loaded record holds its engine name. A record that is not loaded may still be in the
        engine when a load's outcome was unknown (a read timeout while the engine kept loading)
        or the engine refused a second load of a name it already had: its versioned name is
        tried, and the plain name when it was loaded in place and no other record holds that.
        A staged record no load was ever tried for (no ``error``) was never in the engine.
        """
        rec = item.record
        if rec.state in _IN_ENGINE:
            return [rec.engine_name]
        if rec.state == AdapterState.STAGED and rec.error is None:
            return []
        names = list(dict.fromkeys([rec.engine_name, engine_name(rec.name, rec.version)]))
        if rec.mode == "in_place":
            plain = engine_name(rec.name, rec.version, "in_place")
            if plain not in names and self._holder(plain) is None:
                names.append(plain)
        return names

    def stored(self, name: str, version: int) -> tuple[Manifest, Path]:
        """A held version's manifest and directory (for a peer's catch-up or an on-demand
        load). Raises ``AdapterNotFound`` unless its bytes are verified here: loaded, active,
        staged (committed, or evicted from the engine) or failed (the engine refused a load)."""
        item = self._get(name, version)
        if item.record.state not in (*_IN_ENGINE, AdapterState.STAGED, AdapterState.FAILED):
            raise AdapterNotFound(f"{name!r} v{version} is {item.record.state.value} here")
        return item.manifest, Path(item.record.path)

    def canary(self, name: str, version: int) -> Canary | None:
        """The trainer's canary a held version was proven with here (None: proven without
        one). Raises ``AdapterNotFound`` unless the version is loaded or active here."""
        self.stored(name, version)
        return self.db.canary(name, version)

    def list(self) -> list[AdapterRecord]:
        return [i.record for i in self.db.all()]

    async def _update_usage(self) -> None:
        with contextlib.suppress(OSError):
            self.metrics.store_bytes.set(await asyncio.to_thread(self.store.usage))
