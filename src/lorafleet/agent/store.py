"""The agent's on-disk store: staging, a content-addressed blob store and adapter directories.

Layout under ``data_dir``::

    staging/<upload_id>/<path>.partial     bytes of an upload in flight
    blobs/sha256/<hex>                     verified files, immutable, named by content
    adapters/<name>/<version>/<path>       hard links into blobs/ (what the engine reads)
    adapters/<name>/current                a symlink to the version an SGLang engine holds in
                                           place under the plain name (see ``point_link``)

An adapter directory holds hard links, never copies: a blob's link count tells whether any
adapter still uses it, and removing a directory never touches bytes another version shares.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import threading
import uuid
from pathlib import Path

__all__ = ["LINK", "Store", "free_bytes", "fsync_dir"]

LINK = "current"


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Store:
    """Paths and the few filesystem operations that must be atomic and durable."""

    def __init__(self, data_dir: str | os.PathLike) -> None:
        self.root = Path(data_dir).resolve()
        self.staging = self.root / "staging"
        self.blobs = self.root / "blobs" / "sha256"
        self.adapters = self.root / "adapters"
        for d in (self.staging, self.blobs, self.adapters):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._blob_total: int | None = None
        """Bytes under blobs/, counted once and then kept up to date (no walk per request)."""

    # --- staging ---------------------------------------------------------------------------

    def clear_staging(self) -> int:
        """Remove everything under staging/ (stale after a restart); return entries removed."""
        n = 0
        for entry in self.staging.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            n += 1
        return n

    def partial_path(self, upload_id: str, path: str) -> Path:
        return self.staging / upload_id / f"{path}.partial"

    def remove_upload(self, upload_id: str) -> None:
        shutil.rmtree(self.staging / upload_id, ignore_errors=True)

    def staging_bytes(self) -> int:
        return _tree_bytes(self.staging)

    # --- blobs -----------------------------------------------------------------------------

    def blob_path(self, sha256: str) -> Path:
        return self.blobs / sha256

    def has_blob(self, sha256: str, size: int) -> bool:
        try:
            return self.blob_path(sha256).stat().st_size == size
        except FileNotFoundError:
            return False

    def adopt_blob(self, src: Path, sha256: str) -> bool:
        """Atomically move a verified, fsynced file into the blob store; False if already there."""
        dst = self.blob_path(sha256)
        if dst.exists():
            src.unlink(missing_ok=True)
            return False
        size = src.stat().st_size
        os.replace(src, dst)
        fsync_dir(self.blobs)
        self._count(size)
        return True

    def _count(self, delta: int) -> None:
        with self._lock:
            if self._blob_total is not None:
                self._blob_total += delta

    def remove_blob_if_unused(self, sha256: str) -> bool:
        """Delete a blob that no adapter directory links to (link count 1)."""
        p = self.blob_path(sha256)
        try:
            st = p.stat()
            if st.st_nlink > 1:
                return False
            p.unlink()
        except FileNotFoundError:
            return False
        self._count(-st.st_size)
        return True

    def blob_bytes(self) -> int:
        with self._lock:
            if self._blob_total is None:
                self._blob_total = _tree_bytes(self.blobs)
            return self._blob_total

    def ingest_file(self, src: Path, size: int, sha256: str, chunk: int = 8 << 20) -> bool:
        """Copy ``src`` into the blob store while hashing it; return True if a blob was added.

        Always a copy, never a hard link: trainers (safetensors, torch.save) rewrite their
        output in place, which would change a linked inode under a registered adapter
        (promise 6). Raises ``SizeExceeded``/``SizeMismatch``/``DigestMismatch``; nothing is
        left behind.
        """
        from lorafleet.agent._verify import check_complete, check_room

        if self.has_blob(sha256, size):
            return False
        tmp = self.staging / f"ingest-{uuid.uuid4().hex}.partial"
        h = hashlib.sha256()
        n = 0
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                while True:
                    buf = fin.read(chunk)
                    if not buf:
                        break
                    check_room(str(src), n, len(buf), size)
                    n += len(buf)
                    h.update(buf)
                    fout.write(buf)
                fout.flush()
                os.fsync(fout.fileno())
            check_complete(str(src), n, size, h.hexdigest(), sha256)
            return self.adopt_blob(tmp, sha256)
        finally:
            tmp.unlink(missing_ok=True)

    # --- adapter directories ---------------------------------------------------------------

    def adapter_dir(self, name: str, version: int) -> Path:
        return self.adapters / name / str(version)

    def assemble(
        self, name: str, version: int, files: dict[str, str], extra: dict[str, bytes] | None = None
    ) -> Path:
        """Hard-link blobs into a fresh adapter directory, atomically; return its path.

        ``files`` maps the file path in the adapter to its sha256; ``extra`` holds small files
        written directly (the adapter_config.json of a native-only checkpoint).
        """
        final = self.adapter_dir(name, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{version}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for path, sha in files.items():
                os.link(self.blob_path(sha), tmp / path)
            for path, data in (extra or {}).items():
                with open(tmp / path, "wb") as f:
                    f.write(data)
                    os.fsync(f.fileno())
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def link_path(self, name: str) -> Path:
        return self.adapters / name / LINK

    def point_link(self, name: str, version: int) -> Path:
        """Atomically point ``adapters/<name>/current`` at that version's directory.

        SGLang remembers the path a name was loaded from and silently re-reads it after an
        unload (docs/engines/sglang.md): loading the plain name from this link keeps every such
        re-read on the version the agent last put there.
        """
        link = self.link_path(name)
        tmp = link.parent / f".{LINK}.tmp-{uuid.uuid4().hex[:8]}"
        os.symlink(str(version), tmp)
        os.replace(tmp, link)
        fsync_dir(link.parent)
        return link

    def remove_link(self, name: str) -> None:
        self.link_path(name).unlink(missing_ok=True)

    def remove_adapter_dir(self, name: str, version: int, shas: list[str]) -> list[str]:
        """Delete an adapter directory, then every blob in ``shas`` it was the last user of."""
        d = self.adapter_dir(name, version)
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            d.parent.rmdir()  # only succeeds once the name has no versions left
        return [sha for sha in shas if self.remove_blob_if_unused(sha)]

    def sweep(self, known: set[tuple[str, int]]) -> int:
        """At startup (no session open): remove what no record accounts for; return how many.

        Leftover ``adapters/<name>/.<version>.tmp-*`` directories of an interrupted assemble,
        adapter directories with no row in the state DB (a crash between writing one and the
        other; none was ever loaded, or it was unloaded already), then every blob no adapter
        directory links to (link count 1).
        """
        n = 0
        for name_dir in list(self.adapters.iterdir()):
            if not name_dir.is_dir() or name_dir.is_symlink():
                continue
            for d in list(name_dir.iterdir()):
                tmp = d.name.startswith(".") and ".tmp-" in d.name
                if d.name == LINK and d.is_symlink():
                    target = os.readlink(d)
                    if target.isdigit() and (name_dir.name, int(target)) in known:
                        continue  # a link to a known version stays; any other goes below
                orphan = not tmp and (
                    not d.name.isdigit() or (name_dir.name, int(d.name)) not in known
                )
                if tmp or orphan:
                    if d.is_dir() and not d.is_symlink():
                        shutil.rmtree(d, ignore_errors=True)
                    else:
                        d.unlink(missing_ok=True)
                    n += 1
            with contextlib.suppress(OSError):
                name_dir.rmdir()
        for blob in list(self.blobs.iterdir()):
            with contextlib.suppress(OSError):
                if blob.lstat().st_nlink <= 1:
                    blob.unlink()
                    n += 1
        with self._lock:
            self._blob_total = None  # recounted on first use
        return n

    def usage(self) -> int:
        """Bytes the store holds: blobs (adapter dirs are links to them) plus staging."""
        return self.blob_bytes() + self.staging_bytes()


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError as exc:  # pragma: no cover - only on a vanished data dir
        if exc.errno == errno.ENOENT:
            return 0
        raise
    return st.f_bavail * st.f_frsize
