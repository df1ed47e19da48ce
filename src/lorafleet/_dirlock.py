"""One writer per directory: the agent's store, the router's state, a local fleet's data dir.

The lock is an ``flock`` on ``<dir>/.lorafleet.lock`` (the ``filelock`` library): the kernel drops
it when its process dies, so a crash never leaves a stale lock behind. The holder writes who it is
to ``<dir>/.lorafleet.holder`` (a separate file: acquiring the lock truncates the lock file), so a
refused process can say which process holds the directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import BaseFileLock, FileLock, Timeout

__all__ = ["DirectoryLocked", "lock_directory"]

LOCK_FILE = ".lorafleet.lock"
HOLDER_FILE = ".lorafleet.holder"


class DirectoryLocked(RuntimeError):
    """Another process holds the directory's single-writer lock."""

    def __init__(self, path: Path, holder: str | None) -> None:
        self.path = path
        self.holder = holder
        super().__init__(
            f"another lorafleet process is already running on {path} "
            f"({holder or 'holder unknown'}); stop it or use another directory"
        )


def lock_directory(path: str | os.PathLike, *, holder: str) -> BaseFileLock:
    """Take the single-writer lock of ``path`` (created if missing) for this process.

    ``holder`` says who takes it (e.g. ``"lorafleet agent on 127.0.0.1:8100"``); the pid is
    added. Keep the returned lock referenced for as long as the directory is in use, and
    ``release()`` it when done (process exit releases it too).

    Raises:
        DirectoryLocked: another process holds it; the message names the directory and holder.
    """
    directory = Path(path).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    # Not thread-local: LocalFleet may be started on one thread and stopped on another.
    lock = FileLock(str(directory / LOCK_FILE), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise DirectoryLocked(directory, _read_holder(directory)) from None
    tmp = directory / f"{HOLDER_FILE}.{os.getpid()}"
    tmp.write_text(f"pid {os.getpid()}, {holder}\n")
    tmp.replace(directory / HOLDER_FILE)  # a refused process never reads half a line
    return lock


def _read_holder(directory: Path) -> str | None:
    try:
        return (directory / HOLDER_FILE).read_text().strip() or None
    except OSError:
        return None
