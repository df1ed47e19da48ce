"""Staged remote uploads for the SkyRL dialect: its per-file PUTs into lorafleet's verified path.

SkyRL's remote-upload protocol sends an adapter as separate files under one client-made
``upload_id``, each with its declared size and sha256, before any load names the upload. Each
file is received by the agent's own ``UploadManager`` (streamed to disk while hashed, refused the
moment it passes its declared size, never held in memory), in a ``Store`` of the upload's own so
that no byte is deduplicated against another upload: the digest echoed to the client is always
of the bytes it sent. A verified file is hard-linked into the upload's adapter directory, which
a load by ``upload_id`` publishes and then removes.

No refusal leaves bytes behind: a refused file discards its whole upload, as SkyRL's server
does. Uploads idle past ``ttl_s`` are reaped, ``DELETE`` reaps one, and a restarted front
starts from an empty upload directory (nothing staged survives a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import click

from lorafleet._settings import setting
from lorafleet.agent.metrics import Metrics
from lorafleet.agent.store import Store
from lorafleet.agent.uploads import UploadLimits, UploadManager
from lorafleet.errors import FileTooLarge, InvalidRequest, QuotaExceeded, ServiceError
from lorafleet.protocol.manifest import FileEntry, Manifest
from lorafleet.protocol.skyrl import (
    CONFIG_FILENAME,
    UPLOAD_FILENAMES,
    UPLOAD_MAX_BYTES,
    WEIGHT_FILENAMES,
    UploadedFile,
)

__all__ = ["SkyRLUploads", "UploadDirLimits"]

log = logging.getLogger("lorafleet.front")

_DIR = "skyrl-uploads"
_ADAPTER = "adapter"


@dataclass
class UploadDirLimits:
    max_file_bytes: int = setting(
        UPLOAD_MAX_BYTES,
        flag="--upload-max-file-bytes",
        type=click.IntRange(min=1),
        help="Per-file cap of a remote upload (a larger declared size is a 413).",
    )
    """Per-file cap: a larger declared size is refused (413) before a body byte is read."""
    quota_bytes: int | None = setting(
        None,
        flag="--upload-quota-bytes",
        type=click.IntRange(min=1),
        help="All staged uploads together (default: the free disk).",
    )
    """All staged uploads together (None: the free disk, less the agent's reserve)."""
    ttl_s: float = setting(
        600.0,
        flag="--upload-ttl",
        type=click.FloatRange(min=0.1),
        help="Seconds an upload may sit idle (no PUT, no load) before it is reaped.",
    )
    """An upload idle this long (no PUT, no load) is reaped."""


@dataclass
class _Upload:
    id: str
    store: Store
    manager: UploadManager
    files: dict[str, FileEntry] = field(default_factory=dict)
    busy: int = 0
    """PUTs and loads using it now: never reaped meanwhile."""
    receiving: set[str] = field(default_factory=set)
    last_active: float = field(default_factory=time.monotonic)


class SkyRLUploads:
    """Uploads staged under ``root/skyrl-uploads/<upload_id>/``; the directory is the front's."""

    def __init__(self, root: Path, limits: UploadDirLimits) -> None:
        self.root = Path(root).resolve() / _DIR
        self.limits = limits
        self.metrics = Metrics()
        self.uploads: dict[str, _Upload] = {}
        # Restart: whatever a previous front staged is stale (its trainer's load is long gone).
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self._reaper: asyncio.Task | None = None

    # -- receive ----------------------------------------------------------------------------------
    async def put(
        self, upload_id: str, filename: str, size: int, sha256: str, body: AsyncIterator[bytes]
    ) -> UploadedFile:
        """Receive one file. Every refusal discards the whole upload (nothing stays behind).

        Raises ``InvalidRequest`` (400: an unknown file name, more bytes than declared, a size
        or checksum mismatch; a second PUT of a file being received is refused alone),
        ``FileTooLarge`` (413:
        the declared size is negative or over the cap) or ``QuotaExceeded`` (413: staged
        uploads would pass the quota).
        """
        self._start_reaper()
        if filename not in UPLOAD_FILENAMES:
            self.discard(upload_id)
            raise InvalidRequest("Unsupported LoRA adapter file.", param="filename")
        if size < 0 or size > self.limits.max_file_bytes:
            self.discard(upload_id)
            raise FileTooLarge(
                f"LoRA upload exceeds the size limit ({self.limits.max_file_bytes} bytes).",
                param=filename,
            )
        if self.limits.quota_bytes is not None and self.staged_bytes() + size > (
            self.limits.quota_bytes
        ):
            self.discard(upload_id)
            raise QuotaExceeded(
                f"LoRA upload exceeds the size limit: staged uploads may hold at most "
                f"{self.limits.quota_bytes} bytes",
                status=413,
            )
        up = self.uploads.get(upload_id)
        if up is None:
            store = Store(self.root / upload_id)
            limits = UploadLimits(max_file_bytes=self.limits.max_file_bytes, ttl_s=1e9)
            up = self.uploads[upload_id] = _Upload(
                upload_id, store, UploadManager(store, limits, self.metrics)
            )
        if filename in up.receiving:
            # Refused alone: the PUT already receiving this file goes on (nothing of this one
            # was staged).
            raise InvalidRequest(f"{filename!r} of this LoRA upload is being received already")
        up.busy += 1
        up.receiving.add(filename)
        up.last_active = time.monotonic()
        entry = FileEntry(path=filename, size=size, sha256=sha256)
        try:
            # One single-file session per PUT: the agent's path checks the declared size while
            # it streams, then the size and the digest of what arrived.
            # Files of one upload may arrive at once: each has a session name of its own.
            manifest = Manifest(
                name=f"skyrl-{upload_id.replace('-', '')}-{UPLOAD_FILENAMES.index(filename)}",
                version=1,
                config={},
                files=(entry,),
            )
            session = up.manager.open(manifest, lambda _m: None)
            await up.manager.put(
                session.upload_id,
                filename,
                body,
                offset=0,
                content_length=None,
                repr_digest=None,
                content_digest=None,
            )
            up.manager.close(session.upload_id, keep_blobs=True)
            up.files[filename] = entry
            up.store.assemble(_ADAPTER, 1, {p: e.sha256 for p, e in up.files.items()})
        except BaseException as exc:
            up.busy -= 1
            up.receiving.discard(filename)
            self.discard(upload_id)
            if isinstance(exc, ServiceError) and exc.status in (413, 422, 409):
                # SkyRL's statuses: 400 for every byte-level refusal (the code stays precise).
                raise InvalidRequest(
                    f"LoRA upload refused: {exc.message}",
                    code=exc.code,
                    param=filename,
                    status=400,
                ) from exc
            raise
        up.busy -= 1
        up.receiving.discard(filename)
        up.last_active = time.monotonic()
        return UploadedFile(filename=filename, sha256=sha256)

    # -- use --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def claimed(self, upload_id: str):
        """The upload's adapter directory, held (not reaped) for the duration of a load.

        Raises ``InvalidRequest`` "LoRA upload is incomplete." unless it holds
        ``adapter_config.json`` and exactly one weight file.
        """
        up = self.uploads.get(upload_id)
        weights = [f for f in WEIGHT_FILENAMES if up is not None and f in up.files]
        if up is None or CONFIG_FILENAME not in up.files or len(weights) != 1 or up.receiving:
            raise InvalidRequest("LoRA upload is incomplete.", param="upload_id")
        up.busy += 1
        try:
            yield up.store.adapter_dir(_ADAPTER, 1)
        finally:
            up.busy -= 1
            up.last_active = time.monotonic()

    def discard(self, upload_id: str) -> bool:
        """Remove an upload and every byte of it; True if there was one."""
        up = self.uploads.pop(upload_id, None)
        if up is not None:
            for sid in list(up.manager.sessions):
                up.manager.close(sid, keep_blobs=False)
        path = self.root / upload_id
        existed = path.exists()
        shutil.rmtree(path, ignore_errors=True)
        return up is not None or existed

    def staged_bytes(self) -> int:
        """Bytes on disk under the upload directory (a hard-linked file counted once)."""
        seen: dict[tuple[int, int], int] = {}
        for f in self.root.rglob("*"):
            with contextlib.suppress(OSError):
                st = f.lstat()
                if f.is_file():
                    seen[(st.st_dev, st.st_ino)] = st.st_size
        return sum(seen.values())

    # -- reaping ----------------------------------------------------------------------------------
    def reap(self) -> int:
        """Discard uploads idle past the TTL (a load or a PUT in progress is not idle)."""
        now = time.monotonic()
        stale = [
            u.id
            for u in self.uploads.values()
            if not u.busy and now - u.last_active > self.limits.ttl_s
        ]
        for uid in stale:
            log.warning("reaping abandoned SkyRL upload %s", uid)
            self.discard(uid)
        return len(stale)

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def _reap_loop(self) -> None:
        every = max(0.05, min(self.limits.ttl_s / 4, 30.0))
        while True:
            await asyncio.sleep(every)
            self.reap()
            if not self.uploads:
                self._reaper = None
                return

    async def aclose(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reaper
        for uid in list(self.uploads):
            self.discard(uid)
