"""Adapter lifecycle on one replica: commit, register, load, activate, unload, list.

Every operation on one adapter name runs under that name's ``asyncio.Lock``; different names
proceed in parallel. Records are written to the state DB before the call returns, so the
reconciler (and a restarted agent) knows what the engine should hold.

States: ``staged`` (on disk, not in the engine), ``loaded`` (in the engine), ``active`` (loaded
and the name's current version), ``failed`` (the engine refused it; ``error`` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

from lorafleet._service import ServiceError
from lorafleet.agent.backends import (
    AdapterMissing,
    EngineBackend,
    EngineRejected,
    EngineUnavailable,
)
from lorafleet.agent.metrics import Metrics
from lorafleet.agent.state import StateDB, StoredAdapter
from lorafleet.agent.store import Store
from lorafleet.agent.uploads import UploadManager
from lorafleet.bundle import config_rank, validate_adapter_dir
from lorafleet.bundle.manifest import ADAPTER_CONFIG, Manifest, PathError, check_file_path
from lorafleet.errors import DigestMismatch, SizeMismatch
from lorafleet.protocol.agent import (
    AdapterRecord,
    AdapterState,
    EngineCapabilities,
    LoadMode,
    engine_name,
)
from lorafleet.protocol.errors import ErrorCode

__all__ = ["AdapterService"]

_IN_ENGINE = (AdapterState.LOADED, AdapterState.ACTIVE)


def engine_error(exc: Exception) -> ServiceError:
    """A backend error as the protocol error the agent answers with."""
    if isinstance(exc, EngineUnavailable):
        return ServiceError(ErrorCode.ENGINE_UNAVAILABLE, str(exc))
    return ServiceError(ErrorCode.ENGINE_REJECTED, str(exc))


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
                raise ServiceError(
                    ErrorCode.ADAPTER_CONFLICT,
                    f"{manifest.name!r} v{manifest.version} already exists with a different "
                    f"digest ({r.digest[:12]}); unload it first",
                )
            if r.state in _IN_ENGINE and r.version > manifest.version:
                raise ServiceError(
                    ErrorCode.VERSION_CONFLICT,
                    f"{manifest.name!r} v{manifest.version} is not newer than loaded v{r.version}",
                )

    def _get(self, name: str, version: int) -> StoredAdapter:
        item = self.db.get(name, version)
        if item is None:
            raise ServiceError(
                ErrorCode.ADAPTER_NOT_FOUND, f"no adapter {name!r} v{version} on this replica"
            )
        return item

    # --- commit / register -----------------------------------------------------------------

    async def commit(self, upload_id: str) -> AdapterRecord:
        s = self.uploads.get(upload_id)
        m = s.manifest
        async with self.locks[m.name]:
            s = self.uploads.get(upload_id)
            pending = [f.entry.path for f in s.files.values() if not f.complete]
            lost = [f.path for f in m.files if not self.store.has_blob(f.sha256, f.size)]
            if pending or lost:
                raise ServiceError(
                    ErrorCode.UPLOAD_INCOMPLETE,
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

    async def register(self, manifest: Manifest, path: str) -> AdapterRecord:
        """Shared filesystem: verify ``path`` against ``manifest``, ingest into blobs, stage."""
        for f in manifest.files:
            try:
                check_file_path(f.path)
            except PathError as exc:
                code = ErrorCode.PATH_ESCAPE if exc.kind == "escape" else ErrorCode.FILE_NOT_ALLOWED
                raise ServiceError(code, str(exc), param=f.path) from None
            if f.size > self.uploads.limits.max_file_bytes:
                raise ServiceError(
                    ErrorCode.FILE_TOO_LARGE,
                    f"file {f.path!r} is {f.size} bytes, over the per-file cap of "
                    f"{self.uploads.limits.max_file_bytes} bytes",
                )
        src = Path(path).resolve()
        if not self.allow or not any(src == a or a in src.parents for a in self.allow):
            raise ServiceError(
                ErrorCode.PATH_NOT_ALLOWED,
                f"{path!r} (resolved {str(src)!r}) is outside the shared-filesystem allow-list",
            )
        async with self.locks[manifest.name]:
            self.check_version(manifest)
            needed = sum(
                f.size for f in manifest.files if not self.store.has_blob(f.sha256, f.size)
            )
            available = self.uploads.available_bytes()
            if needed > available:
                raise ServiceError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"registering {manifest.name!r} needs {needed} bytes, {available} available",
                )
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
                    raise ServiceError(ErrorCode.PATH_NOT_ALLOWED, f"{f.path!r} is a symlink out")
                await asyncio.to_thread(self.store.ingest_file, file_src, f.size, f.sha256)
        except FileNotFoundError as exc:
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"missing file: {exc}") from None
        except (SizeMismatch, DigestMismatch) as exc:
            kind = "size" if isinstance(exc, SizeMismatch) else "digest"
            self.metrics.verification_failures.labels(kind).inc()
            code = ErrorCode.SIZE_MISMATCH if kind == "size" else ErrorCode.DIGEST_MISMATCH
            raise ServiceError(code, str(exc)) from None

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
            raise ServiceError(
                ErrorCode.ADAPTER_INVALID,
                f"{m.name!r} v{m.version} is not a loadable adapter: " + "; ".join(report.problems),
            )
        rec = AdapterRecord(
            name=m.name,
            version=m.version,
            digest=m.digest,
            engine_name=engine_name(m.name, m.version),
            mode="versioned",
            state=AdapterState.STAGED,
            path=str(path),
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
            if rec.state in _IN_ENGINE:
                raise ServiceError(
                    ErrorCode.ADAPTER_CONFLICT,
                    f"{name!r} v{version} is loaded as {rec.mode}; unload it before loading "
                    f"as {mode}",
                )
            newer = [
                i.record.version for i in self.db.by_name(name) if i.record.state in _IN_ENGINE
            ]
            if mode == "in_place" and newer and max(newer) > version:
                raise ServiceError(
                    ErrorCode.VERSION_CONFLICT,
                    f"{name!r} v{max(newer)} is loaded; v{version} may not replace it",
                )
            rank = config_rank(item.manifest.config)
            if rank is not None and self.caps.max_lora_rank and rank > self.caps.max_lora_rank:
                raise ServiceError(
                    ErrorCode.ADAPTER_INVALID,
                    f"{name!r} v{version} has LoRA rank {rank}, over the engine's max_lora_rank "
                    f"{self.caps.max_lora_rank}",
                )
            # In place, the previous holder of the plain name gives its engine slot to us.
            holder = self._holder(ename)
            if self.caps.max_adapters is not None and holder is None:
                held = {i.record.engine_name for i in self.db.all() if i.record.state in _IN_ENGINE}
                if len(held) >= self.caps.max_adapters:
                    raise ServiceError(
                        ErrorCode.QUOTA_EXCEEDED,
                        f"the engine already holds {len(held)} adapters, its limit is "
                        f"{self.caps.max_adapters}; unload one before loading {ename!r}",
                    )
            t0 = time.perf_counter()
            # Recorded before the call: if its outcome is unknown (timeout, cancellation, crash)
            # the engine may hold ``ename`` from these files, and unload must ask it first.
            attempt = {"mode": mode, "engine_name": ename}
            pending = rec.model_copy(
                update={**attempt, "error": f"loading as {ename!r}: outcome unknown"}
            )
            self.db.put(StoredAdapter(pending, item.manifest))
            try:
                await self.backend.load(ename, rec.path, replace=holder is not None)
            except EngineRejected as exc:
                rec = rec.model_copy(
                    update={**attempt, "state": AdapterState.FAILED, "error": str(exc)}
                )
                self.db.put(StoredAdapter(rec, item.manifest))
                raise engine_error(exc) from None
            except EngineUnavailable as exc:
                rec = pending.model_copy(
                    update={"error": f"loading as {ename!r}: outcome unknown: {exc}"}
                )
                self.db.put(StoredAdapter(rec, item.manifest))
                raise engine_error(exc) from None
            self.metrics.load_seconds.observe(time.perf_counter() - t0)
            state = AdapterState.LOADED
            if holder is not None:
                # The replaced version leaves the engine; its files may go when it is unloaded.
                if holder.record.state == AdapterState.ACTIVE:
                    state = AdapterState.ACTIVE
                old = holder.record.model_copy(update={"state": AdapterState.STAGED, "error": None})
                self.db.put(StoredAdapter(old, holder.manifest))
            rec = rec.model_copy(
                update={"state": state, "mode": mode, "engine_name": ename, "error": None}
            )
            self.db.put(StoredAdapter(rec, item.manifest))
            return rec

    def _holder(self, ename: str) -> StoredAdapter | None:
        for i in self.db.all():
            if i.record.engine_name == ename and i.record.state in _IN_ENGINE:
                return i
        return None

    async def activate(self, name: str, version: int) -> AdapterRecord:
        async with self.locks[name]:
            item = self._get(name, version)
            if item.record.state not in _IN_ENGINE:
                raise ServiceError(
                    ErrorCode.ADAPTER_CONFLICT,
                    f"{name!r} v{version} is {item.record.state.value}; load it before activating",
                )
            for other in self.db.by_name(name):
                if other.record.state == AdapterState.ACTIVE and other.record.version != version:
                    r = other.record.model_copy(update={"state": AdapterState.LOADED})
                    self.db.put(StoredAdapter(r, other.manifest))
            rec = item.record.model_copy(update={"state": AdapterState.ACTIVE})
            self.db.put(StoredAdapter(rec, item.manifest))
            return rec

    async def unload(self, name: str, version: int) -> AdapterRecord:
        """Remove from the engine (if there), then the files: never the other way round."""
        async with self.locks[name]:
            item = self._get(name, version)
            rec = item.record
            for ename in self._engine_names(item):
                try:
                    await self.backend.unload(ename)
                except AdapterMissing:
                    pass  # already gone (engine restarted, or never got there)
                except (EngineRejected, EngineUnavailable) as exc:
                    # Keep the files: the engine may hold them (promise 6).
                    raise engine_error(exc) from None
            self.db.delete(name, version)
            shas = item.shas
            await asyncio.to_thread(self.store.remove_adapter_dir, name, version, [])
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
        names = [engine_name(rec.name, rec.version)]
        if rec.mode == "in_place":
            plain = engine_name(rec.name, rec.version, "in_place")
            if plain not in names and self._holder(plain) is None:
                names.append(plain)
        return names

    def list(self) -> list[AdapterRecord]:
        return [i.record for i in self.db.all()]

    async def _update_usage(self) -> None:
        with contextlib.suppress(OSError):
            self.metrics.store_bytes.set(await asyncio.to_thread(self.store.usage))
