"""Upload sessions: refuse early, stream to disk while hashing, resume, verify, adopt into blobs.

A session is opened for one manifest. Each missing file is PUT as raw bytes; the handler writes
batches off the event loop (write and hash run in parallel threads while the loop receives the
next batch) and stops the moment a file exceeds its declared size. A large file is written with
O_DIRECT (``agent._direct``): copying it into the page cache cost more CPU than hashing it. A broken
connection leaves a durable, fsynced prefix whose length ``HEAD`` reports; the running hash stays
in memory so a resumed PUT does not re-read it. Verified files are fsynced and renamed into
``blobs/sha256/``. Sessions live in memory: staging is cleared at startup, so nothing survives a
restart half-done.

Relay: a session opened with ``relay`` also takes PUT and HEAD from a peer agent presenting the
publication's credential, and a ``ForwardPlan`` makes a PUT from offset 0 tee its bytes to the
plan's targets (``relay.Tee``) while they are written and hashed here. A relayed PUT that gets
no byte for the plan's ``stall_s`` is cut off with 408 ``transfer_stalled``, keeping its prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import httpx

from lorafleet._http import async_client
from lorafleet.agent._body import RawBody
from lorafleet.agent._direct import open_direct
from lorafleet.agent._pipe import Pipe, WriteFailed, rehash
from lorafleet.agent._verify import check_digest, check_room, check_size
from lorafleet.agent.limits import UploadLimits
from lorafleet.agent.metrics import Metrics
from lorafleet.agent.relay import Tee
from lorafleet.agent.store import Store, free_bytes
from lorafleet.errors import (
    DigestMismatch,
    FileTooLarge,
    IntegrityError,
    InternalError,
    InvalidRequest,
    NotFound,
    OffsetMismatch,
    PublishInProgress,
    QuotaExceeded,
    ServiceError,
    SizeExceeded,
    SizeMismatch,
    TransferStalled,
    UploadNotFound,
)
from lorafleet.protocol.agent import (
    UPLOAD_OFFSET_HEADER,
    FileProgress,
    ForwardPlan,
    RelayAccept,
    RelayHop,
    UploadSession,
    UploadStatus,
    credential_digest,
)
from lorafleet.protocol.digests import parse_sha256_digest
from lorafleet.protocol.manifest import FileEntry, Manifest

__all__ = ["UploadLimits", "UploadManager", "parse_sha256_digest"]

_RESERVE = 1 << 30  # free disk kept back when no quota is configured

log = logging.getLogger("lorafleet.agent")


@dataclass
class _File:
    entry: FileEntry
    offset: int = 0
    """Durable (fsynced) bytes in the partial file."""
    hasher: object | None = None
    """sha256 of exactly ``offset`` bytes, or None (re-hash the partial on resume)."""
    complete: bool = False
    task: asyncio.Task | None = None
    """The PUT writing this file now, if any."""
    error: ServiceError | None = None
    """Why its last PUT was refused, if it was (reported by ``GET``, for the Publisher)."""
    relayed: list[RelayHop] = field(default_factory=list)
    forwarded: bool = False
    """Its forward plan was used (by the first PUT from offset 0): never a second time."""


@dataclass
class _Session:
    id: str
    manifest: Manifest
    files: dict[str, _File]
    missing: list[str]
    reserved: int
    added_blobs: set[str] = field(default_factory=set)
    last_active: float = field(default_factory=time.monotonic)
    closed: bool = False
    relay: RelayAccept | None = None
    forward: ForwardPlan | None = None

    def touch(self) -> None:
        self.last_active = time.monotonic()

    @property
    def busy(self) -> bool:
        return any(f.task is not None for f in self.files.values())


class UploadManager:
    """Open sessions, in memory, over the durable ``Store``."""

    def __init__(self, store: Store, limits: UploadLimits, metrics: Metrics) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self.sessions: dict[str, _Session] = {}
        self.pins: Counter[str] = Counter()
        """Blobs a commit or register is about to link: never collected meanwhile."""
        self._relay_http: httpx.AsyncClient | None = None

    def relay_http(self) -> httpx.AsyncClient:
        """The client that forwards relayed files (made on first use, on the running loop)."""
        if self._relay_http is None:
            self._relay_http = async_client(
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=16)
            )
        return self._relay_http

    async def aclose_relay(self) -> None:
        if self._relay_http is not None:
            await self._relay_http.aclose()
            self._relay_http = None

    @contextlib.contextmanager
    def pinned(self, shas: Iterable[str]) -> Iterator[None]:
        """Keep ``shas`` from ``gc_blobs`` for the duration (nested pins add up)."""
        shas = list(shas)
        self.pins.update(shas)
        try:
            yield
        finally:
            self.pins.subtract(shas)
            for sha in shas:
                if self.pins[sha] <= 0:
                    del self.pins[sha]

    # --- open ------------------------------------------------------------------------------

    def open(
        self,
        manifest: Manifest,
        check_version: Callable[[Manifest], None],
        relay: RelayAccept | None = None,
        supersede: bool = False,
    ) -> UploadSession:
        """Refuse at once what can be refused from the manifest; else open a session.

        Idempotent: the same manifest (by digest) while its session is open returns that session
        (taking the new ``relay`` grant: the one of the publication that asked last).
        ``supersede``: an open session of this name for other bytes (an attempt that was
        abandoned: a failed publication, a catch-up cut off) is closed first instead of
        refusing, so that it never blocks the name until its TTL.
        """
        if supersede:
            for s in list(self.sessions.values()):
                if s.manifest.name == manifest.name and s.manifest.digest != manifest.digest:
                    self.close(s.id, keep_blobs=False)
        for s in self.sessions.values():
            if s.manifest.name == manifest.name and s.manifest.digest == manifest.digest:
                # The same bundle again: a publisher whose answer to the first open was lost
                # (a timeout, a cancelled call) gets its session back, to resume or discard it.
                s.touch()
                s.relay, s.forward = relay, None
                done = [p for p, f in s.files.items() if f.complete]
                return UploadSession(
                    upload_id=s.id,
                    missing=[p for p in s.files if p not in done],
                    present=done,
                    expires_in_s=self.limits.ttl_s,
                )
            if s.manifest.name == manifest.name:
                raise PublishInProgress(
                    f"upload {s.id} for adapter {manifest.name!r} (version "
                    f"{s.manifest.version}) is still open; commit or discard it first",
                )
        check_version(manifest)
        missing, present, needed = self.admit(manifest)
        sid = uuid.uuid4().hex
        files = {p: _File(manifest.file(p)) for p in missing}
        for p in present:
            files[p] = _File(manifest.file(p), offset=manifest.file(p).size, complete=True)
        self.sessions[sid] = _Session(sid, manifest, files, missing, reserved=needed, relay=relay)
        return UploadSession(
            upload_id=sid, missing=missing, present=present, expires_in_s=self.limits.ttl_s
        )

    def admit(self, manifest: Manifest) -> tuple[list[str], list[str], int]:
        """Size and quota admission, for uploads and shared-filesystem registration alike.

        Returns (paths to receive, paths already in the store, bytes to reserve). Raises
        ``FileTooLarge`` for a file over the per-file cap and ``QuotaExceeded`` when the store
        cannot take the missing bytes (each distinct blob counted once).
        """
        for f in manifest.files:
            if f.size > self.limits.max_file_bytes:
                raise FileTooLarge(
                    f"file {f.path!r} is {f.size} bytes, over the per-file cap of "
                    f"{self.limits.max_file_bytes} bytes",
                    param=f.path,
                )
        missing, present, needed, seen = [], [], 0, set()
        for f in manifest.files:
            if self.store.has_blob(f.sha256, f.size):
                present.append(f.path)
            else:
                missing.append(f.path)
                if f.sha256 not in seen:
                    needed += f.size
                    seen.add(f.sha256)
        available = self.available_bytes()
        if needed > available:
            raise QuotaExceeded(
                f"adapter {manifest.name!r} v{manifest.version} needs {needed} bytes of storage, "
                f"only {available} bytes are available",
            )
        return missing, present, needed

    def available_bytes(self) -> int:
        """Bytes a new session may reserve: quota (or free disk) minus what is used or promised."""
        if self.limits.quota_bytes is not None:
            own = sum(
                self.store.blob_path(sha).stat().st_size
                for s in self.sessions.values()
                for sha in s.added_blobs
                if self.store.blob_path(sha).exists()
            )
            committed = self.store.blob_bytes() - own
            promised = sum(s.reserved for s in self.sessions.values())
            return max(0, self.limits.quota_bytes - committed - promised)
        outstanding = sum(
            s.reserved - sum(f.offset for f in s.files.values() if not f.complete)
            for s in self.sessions.values()
        )
        return max(0, free_bytes(self.store.root) - _RESERVE - outstanding)

    # --- lookup ----------------------------------------------------------------------------

    def get(self, upload_id: str) -> _Session:
        s = self.sessions.get(upload_id)
        if s is None or s.closed:
            raise UploadNotFound(f"no open upload {upload_id!r}")
        return s

    def _file(self, s: _Session, path: str) -> _File:
        f = s.files.get(path)
        if f is None:
            raise NotFound(f"file {path!r} is not in upload {s.id}'s manifest", param=path)
        return f

    def relay_peer(self, upload_id: str, token: str) -> bool:
        """Does ``token`` open this session's files to a peer (its publication's credential)?"""
        s = self.sessions.get(upload_id)
        if s is None or s.closed or s.relay is None:
            return False
        return hmac.compare_digest(credential_digest(token), s.relay.credential_sha256)

    def set_forward(self, upload_id: str, plan: ForwardPlan) -> UploadStatus:
        """Install where this session's files go on (see ``ForwardPlan``). Raises
        ``InvalidRequest`` for a path that is not one this session still receives."""
        s = self.get(upload_id)
        for path in plan.files:
            f = s.files.get(path)
            if f is None or f.complete or f.forwarded or f.offset or f.task is not None:
                raise InvalidRequest(
                    f"{path!r} is not a file that upload {s.id} is about to receive from its "
                    "first byte",
                    param="files",
                )
            if any(t.upload_id == s.id for t in plan.files[path]):
                raise InvalidRequest(f"{path!r}: a session cannot forward to itself", param="files")
        s.forward = plan
        s.touch()
        return self.status(upload_id)

    def offset(self, upload_id: str, path: str) -> int:
        s = self.get(upload_id)
        s.touch()
        return self._file(s, path).offset

    def status(self, upload_id: str) -> UploadStatus:
        s = self.get(upload_id)
        return UploadStatus(
            upload_id=s.id,
            name=s.manifest.name,
            version=s.manifest.version,
            files=[_progress(f) for f in s.files.values()],
        )

    # --- PUT -------------------------------------------------------------------------------

    async def put(
        self,
        upload_id: str,
        path: str,
        body: AsyncIterator[bytes],
        *,
        offset: int | None,
        content_length: int | None,
        repr_digest: str | None,
        content_digest: str | None,
        peer: bool = False,
        raw: RawBody | None = None,
    ) -> FileProgress:
        """Receive one file's bytes from ``offset``. ``peer``: sent by a relaying agent (cut off
        after the session's ``stall_s`` without a byte). ``raw``: the same body, readable by
        the transport straight into the receive buffers (used unless the bytes are teed)."""
        s = self.get(upload_id)
        f = self._file(s, path)
        entry = f.entry
        if f.complete:
            return _progress(f)  # idempotent: already verified (or deduplicated)
        if f.task is not None:
            raise OffsetMismatch(
                f"another PUT for {path!r} is in progress",
                headers={UPLOAD_OFFSET_HEADER: str(f.offset)},
            )
        start = offset or 0
        if start != f.offset:
            raise OffsetMismatch(
                f"{path!r}: Upload-Offset {start} differs from the durable offset {f.offset}",
                headers={UPLOAD_OFFSET_HEADER: str(f.offset)},
            )
        if repr_digest is not None:
            want = parse_sha256_digest(repr_digest, "Repr-Digest")
            if want != entry.sha256:
                self.metrics.verification_failures.labels("digest").inc()
                raise DigestMismatch(
                    f"{path!r}: Repr-Digest sha256 {want} differs from the manifest's "
                    f"{entry.sha256}",
                    param=path,
                )
        chunk_want = (
            parse_sha256_digest(content_digest, "Content-Digest") if content_digest else None
        )
        if content_length is not None and start + content_length > entry.size:
            self.metrics.verification_failures.labels("size").inc()
            self._reset(s, f)
            raise SizeExceeded(
                f"{path!r}: Content-Length {content_length} from offset {start} exceeds the "
                f"declared size of {entry.size} bytes",
                param=path,
            )
        tee, direct = None, set()
        plan = s.forward
        if plan is not None and start == 0 and not f.forwarded and plan.files.get(path):
            f.forwarded = True
            tee = Tee(self.relay_http(), plan.files[path], entry, plan.credential, plan.stall_s)
            direct = {t.upload_id for t in plan.files[path]}
        stall_s = s.relay.stall_s if peer and s.relay is not None else None
        if stall_s is not None:
            body = _stall_guard(body, stall_s)
        # The Tee takes bytes objects it may hold on to; the ring's buffers are reused.
        if raw is not None and (tee is not None or not raw.usable()):
            raw = None
        f.task = asyncio.current_task()
        f.error, f.relayed = None, []
        s.touch()
        t0 = time.perf_counter()
        try:
            return await self._receive(s, f, body, chunk_want, tee, raw, stall_s)
        except TimeoutError:
            if not peer or s.relay is None:
                raise
            self.metrics.stalled_uploads.inc()
            f.error = TransferStalled(
                f"{path!r}: no byte for {s.relay.stall_s:g} s; {f.offset} bytes are durable",
                headers={UPLOAD_OFFSET_HEADER: str(f.offset)},
            )
            raise f.error from None
        except ServiceError as exc:
            f.error = exc
            raise
        finally:
            f.task = None
            s.touch()
            self.metrics.upload_seconds.observe(time.perf_counter() - t0)
            if tee is not None:
                tee.close()
            for hop in f.relayed if tee is not None else ():
                if hop.upload_id in direct:  # this hop's own targets, not theirs in turn
                    self.metrics.relay_hops.labels("ok" if hop.ok else hop.code or "error").inc()

    async def _receive(
        self,
        s: _Session,
        f: _File,
        body: AsyncIterator[bytes],
        chunk_want: str | None,
        tee: Tee | None,
        raw: RawBody | None = None,
        stall_s: float | None = None,
    ) -> FileProgress:
        entry = f.entry
        partial = self.store.partial_path(s.id, entry.path)
        partial.parent.mkdir(parents=True, exist_ok=True)
        if f.hasher is None:
            f.hasher = (
                await asyncio.to_thread(rehash, str(partial), f.offset)
                if f.offset
                else hashlib.sha256()
            )
        hasher = f.hasher
        chash = hashlib.sha256() if chunk_want else None
        hashers = (hasher, chash) if chash else (hasher,)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, f.offset)  # drop anything past the durable offset
            os.lseek(fd, f.offset, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        dfd = -1
        floor = self.limits.direct_io_min_bytes
        if floor is not None and entry.size >= floor:
            dfd = open_direct(str(partial))
        start = received = f.offset
        # Owns fd and dfd from here: only its write thread closes them.
        pipe = Pipe(fd, hashers, f.offset, entry.size - f.offset, dfd)
        refused = False
        cancelled = False
        try:
            if raw is not None:
                # Content-Length was checked against the declared size: no byte can be extra.
                try:
                    await raw.read_into(pipe, stall_s, s.touch)
                finally:
                    received = start + raw.received
                    self.metrics.bytes_received.inc(raw.received)
                if s.closed:
                    refused = True
                    raise UploadNotFound(f"upload {s.id} was discarded")
            else:
                async for chunk in body:
                    if not chunk:
                        continue
                    try:
                        check_room(repr(entry.path), received, len(chunk), entry.size, entry.path)
                    except SizeExceeded:
                        refused = True
                        self.metrics.verification_failures.labels("size").inc()
                        raise
                    if tee is not None:
                        await tee.feed(chunk)  # the next hop gets it before this one writes it
                    received += len(chunk)
                    self.metrics.bytes_received.inc(len(chunk))
                    await pipe.feed(chunk)
                    s.touch()
                    if s.closed:
                        refused = True
                        raise UploadNotFound(f"upload {s.id} was discarded")
        except WriteFailed:
            pass  # answered below, once the written prefix is known
        finally:
            # Every exit (done, refused, broken connection, cancelled) comes through here: the
            # received bytes are written, then fsync and close run on the write thread after
            # every queued write, so no write can land in a reused descriptor. A cancel that
            # arrives meanwhile is remembered and re-raised once this is done.
            if refused:
                pipe.drop()
            cancelled = await pipe.finish()
            if refused:
                self._reset(s, f)
            elif pipe.error is not None:
                # A batch was not written: the hash covers bytes that are not on disk. Keep
                # only the written prefix, and re-hash it from disk on resume.
                f.hasher = None
                f.offset = start + pipe.written
                log.warning("writing %s failed: %s", partial, pipe.error)
            else:
                f.offset = received  # all written and fsynced; the running hash matches
            if s.closed:
                self.store.remove_upload(s.id)
            if tee is not None and (cancelled or received != entry.size):
                # This copy broke off: so do the forwarded ones (each keeps its durable prefix).
                f.relayed = await tee.abort(f"the upstream copy broke off after {received} bytes")
                tee = None
            if cancelled:
                raise asyncio.CancelledError
        if pipe.error is not None:
            raise InternalError(
                f"{entry.path!r}: writing to the store failed after {f.offset} bytes: "
                f"{pipe.error}; resume from Upload-Offset",
                headers={UPLOAD_OFFSET_HEADER: str(f.offset)},
            )

        def refuse(kind: type[IntegrityError], message: str) -> IntegrityError:
            # Nothing of a file that failed verification stays behind.
            self.metrics.verification_failures.labels("digest").inc()
            self._reset(s, f)
            return kind(f"{entry.path!r}: {message}", param=entry.path)

        if tee is not None:
            # Every byte went on: the targets judge their copies themselves (a corrupt one is
            # refused there too), and their verdicts are reported whatever this copy's is.
            f.relayed = await tee.finish()
        what = repr(entry.path)
        try:
            check_size(what, received, entry.size, entry.path)
        except SizeMismatch:
            self.metrics.verification_failures.labels("size").inc()
            self._reset(s, f)
            raise
        if chash is not None and chash.hexdigest() != chunk_want:
            raise refuse(
                DigestMismatch,
                f"Content-Digest sha256 {chunk_want}, body hashed to {chash.hexdigest()}",
            )
        try:
            check_digest(what, hasher.hexdigest(), entry.sha256, entry.path)
        except DigestMismatch:
            self.metrics.verification_failures.labels("digest").inc()
            self._reset(s, f)
            raise
        if self.store.adopt_blob(partial, entry.sha256):
            s.added_blobs.add(entry.sha256)
        f.complete = True
        f.hasher = None
        return _progress(f)

    def _reset(self, s: _Session, f: _File) -> None:
        """Forget every byte of one file (after a refusal nothing of it may remain)."""
        self.store.partial_path(s.id, f.entry.path).unlink(missing_ok=True)
        f.offset = 0
        f.hasher = None

    # --- close -----------------------------------------------------------------------------

    def close(self, upload_id: str, *, keep_blobs: bool) -> None:
        """End a session: remove its staging; unless ``keep_blobs``, GC its manifest's blobs."""
        s = self._detach(upload_id)
        if s is not None:
            self.store.remove_upload(upload_id)
            self._release(s, keep_blobs)

    async def aclose(self, upload_id: str, *, keep_blobs: bool) -> None:
        """``close``, with the (possibly large) staging removed off the event loop."""
        s = self._detach(upload_id)
        if s is not None:
            await asyncio.to_thread(self.store.remove_upload, upload_id)
            self._release(s, keep_blobs)

    def _detach(self, upload_id: str) -> _Session | None:
        s = self.sessions.pop(upload_id, None)
        if s is None:
            return None
        s.closed = True
        for f in s.files.values():
            if f.task is not None and f.task is not asyncio.current_task():
                f.task.cancel()
        return s

    def _release(self, s: _Session, keep_blobs: bool) -> None:
        if not keep_blobs:
            # Every file of the manifest, not only those this session added: a blob that was
            # present at open may have lost its last adapter since (it stayed for this session).
            self.gc_blobs({f.sha256 for f in s.manifest.files})

    def gc_blobs(self, shas: Iterable[str]) -> None:
        """Remove blobs no adapter links to, no open session expects and nobody pinned."""
        wanted = {f.sha256 for s in self.sessions.values() for f in s.manifest.files}
        for sha in shas:
            if sha not in wanted and sha not in self.pins:
                self.store.remove_blob_if_unused(sha)

    def _stale(self) -> list[str]:
        now = time.monotonic()
        return [s.id for s in self.sessions.values() if now - s.last_active > self.limits.ttl_s]

    def reap(self) -> int:
        """Close sessions idle past the TTL (cancelling a stalled PUT); return how many."""
        stale = self._stale()
        for sid in stale:
            self.close(sid, keep_blobs=False)
        if stale:
            self.metrics.reaped_uploads.inc(len(stale))
        return len(stale)

    async def areap(self) -> int:
        """``reap``, removing staging off the event loop."""
        stale = self._stale()
        for sid in stale:
            await self.aclose(sid, keep_blobs=False)
        if stale:
            self.metrics.reaped_uploads.inc(len(stale))
        return len(stale)


async def _stall_guard(body: AsyncIterator[bytes], stall_s: float) -> AsyncIterator[bytes]:
    """``body``, raising ``TimeoutError`` once no chunk has come for ``stall_s``."""
    it = aiter(body)
    while True:
        try:
            async with asyncio.timeout(stall_s):
                chunk = await anext(it)
        except StopAsyncIteration:
            return
        yield chunk


def _progress(f: _File) -> FileProgress:
    return FileProgress(
        path=f.entry.path,
        size=f.entry.size,
        sha256=f.entry.sha256,
        offset=f.offset,
        complete=f.complete,
        receiving=f.task is not None,
        error_code=f.error.code if f.error else None,
        error=f.error.message if f.error else None,
        relayed=f.relayed,
    )
