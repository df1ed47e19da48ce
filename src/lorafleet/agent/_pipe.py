"""One file's bytes written by one thread and hashed by another, while the loop receives more."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from lorafleet.agent._direct import DirectWriter

__all__ = ["BATCH", "Pipe", "WriteFailed", "rehash"]

BATCH = 4 << 20  # bytes handed to the writer threads at once
_IOV_MAX = 512


def _write_and_hash(fd: int, parts: list[bytes]) -> None:
    for i in range(0, len(parts), _IOV_MAX):
        chunk = parts[i : i + _IOV_MAX]
        todo = sum(len(p) for p in chunk)
        n = os.writev(fd, chunk)
        if n != todo:  # short write: finish the rest plainly
            rest = memoryview(b"".join(chunk))[n:]
            while rest:
                rest = rest[os.write(fd, rest) :]


def _hash_parts(parts: list[bytes], *hashers) -> None:
    for p in parts:
        for h in hashers:
            h.update(p)


class WriteFailed(Exception):
    """A batch could not be written; stop receiving."""


class Pipe:
    """Batches written by one thread and hashed by another, each in order, for one descriptor.

    The descriptor belongs to the write thread: ``finish`` queues fsync and close behind every
    write, so it is never closed while a write is pending. After a failed write, later batches
    are skipped, ``error`` is set and ``written`` counts only the bytes that reached the file.
    """

    def __init__(self, fd: int, hashers: tuple, direct: DirectWriter | None = None) -> None:
        self.fd = fd
        self.hashers = hashers
        self.direct = direct
        self.wx = ThreadPoolExecutor(1, thread_name_prefix="upload-write")
        self.hx = ThreadPoolExecutor(1, thread_name_prefix="upload-hash")
        self.pending: deque[tuple[Future, Future]] = deque()
        self.written = 0
        self.error: BaseException | None = None

    def _write(self, parts: list[bytes], n: int) -> None:
        if self.error is not None:
            return  # nothing after a hole
        try:
            if self.direct is not None:
                self.direct.write(parts)
            else:
                _write_and_hash(self.fd, parts)
                self.written += n
        except BaseException as exc:
            self.error = exc
        finally:
            if self.direct is not None:  # what reached the file, even if a write failed
                self.written = self.direct.pos - self.direct.start

    def _close(self) -> None:
        try:
            if self.error is None:
                if self.direct is not None:
                    self.direct.flush_tail()
                os.fsync(self.fd)
        except BaseException as exc:
            self.error = exc
            self.written = 0  # nothing is known to be durable
        finally:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            if self.direct is not None:
                self.direct.close()

    def submit(self, parts: list[bytes]) -> None:
        n = sum(len(p) for p in parts)
        w = self.wx.submit(self._write, parts, n)
        h = self.hx.submit(_hash_parts, parts, *self.hashers)
        self.pending.append((w, h))

    async def backlog(self, limit: int) -> None:
        """Wait until at most ``limit`` batches are queued; raise if a write failed."""
        while len(self.pending) > limit:
            w, h = self.pending[0]
            await asyncio.shield(asyncio.wrap_future(w))
            await asyncio.shield(asyncio.wrap_future(h))
            self.pending.popleft()
            if self.error is not None:
                raise WriteFailed

    async def finish(self) -> bool:
        """Close after every queued write, wait for every hash; True if cancelled meanwhile."""
        done = (self.wx.submit(self._close), self.hx.submit(lambda: None))
        self.wx.shutdown(wait=False)
        self.hx.shutdown(wait=False)
        cancelled = False
        for fut in done:
            af = asyncio.wrap_future(fut)
            while not af.done():
                try:
                    await asyncio.shield(af)
                except asyncio.CancelledError:
                    cancelled = True
                except BaseException:
                    break
        for _, h in self.pending:
            if h.exception() is not None and self.error is None:
                self.error = h.exception()
                self.written = 0
        return cancelled


def rehash(path: str, length: int) -> object:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = length
        while left:
            buf = f.read(min(BATCH, left))
            if not buf:
                break
            h.update(buf)
            left -= len(buf)
    return h
