"""One file's bytes received into aligned buffers, hashed by one thread and written by another
from the same buffer, while the loop receives into the next.

Each byte is copied once into a page-aligned buffer (by the kernel's ``recv_into`` on the raw
path, ``agent._body``; by one slice assignment for ASGI chunks), then read by sha256 and, for a
large file, written with O_DIRECT straight from that buffer (``agent._direct``). A buffer goes
back to the ring once both threads are done with it; with every buffer in flight the receiver
waits (``space``), which paces the sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from lorafleet.agent._direct import ALIGN, write_direct

__all__ = ["BATCH", "RING", "Pipe", "WriteFailed", "rehash"]

BATCH = 4 << 20  # one buffer: the bytes the threads get at once
RING = 4  # buffers per file: one filling while the others are hashed and written


def _write_plain(fd: int, view: memoryview, pos: int) -> None:
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


class WriteFailed(Exception):
    """A buffer could not be written; stop receiving."""


class Pipe:
    """The ring of buffers for one descriptor, written by one thread and hashed by another.

    The descriptors belong to the write thread: ``finish`` queues fsync and close behind every
    write, so they are never closed while a write is pending. After a failed write, later
    buffers are skipped, ``error`` is set and ``written`` counts only the bytes that reached the
    file (in order from ``pos``). ``dfd``: an O_DIRECT descriptor of the same file, or -1.
    """

    def __init__(self, fd: int, hashers: tuple, pos: int, left: int, dfd: int = -1) -> None:
        self.fd, self.dfd = fd, dfd
        self.hashers = hashers
        self.start = self.pos = pos
        # A small file gets small buffers; one block of slack for an unaligned start.
        self.size = max(1, min(BATCH, -(-(left + ALIGN) // ALIGN) * ALIGN))
        self.free: deque[memoryview] = deque()  # each over a page-aligned mapping
        self.made = 0
        self.mv: memoryview | None = None
        self.lead = self.fill = 0
        self.wx = ThreadPoolExecutor(1, thread_name_prefix="upload-write")
        self.hx = ThreadPoolExecutor(1, thread_name_prefix="upload-hash")
        self.space = asyncio.Event()
        self.on_space: Callable[[], None] | None = None
        """Called on the loop when a buffer comes back (the raw path resumes reading)."""
        self.loop = asyncio.get_running_loop()
        self.written = 0
        self.error: BaseException | None = None
        self.hash_error: BaseException | None = None

    # --- the loop's side -------------------------------------------------------------------

    def view(self, grow: bool = False) -> memoryview | None:
        """The free part of the buffer being filled, or None while every buffer is in flight
        (``grow``: make one more instead; for a reader that cannot wait)."""
        if self.mv is None:
            if self.free:
                self.mv = self.free.popleft()
            elif self.made < RING or grow:
                self.mv = memoryview(mmap.mmap(-1, self.size))
                self.made += 1
            else:
                return None
            # Buffer offsets match file offsets modulo a block, so O_DIRECT can take the middle.
            self.lead = self.fill = self.pos % ALIGN if self.dfd >= 0 else 0
        return self.mv[self.fill :]

    def advance(self, n: int) -> None:
        """``n`` more bytes are in the buffer's free part; a full buffer goes to the threads."""
        self.fill += n
        if self.fill == self.size:
            self.submit()

    async def feed(self, data: bytes) -> None:
        """Copy one received chunk into the ring, waiting for a free buffer when none is."""
        src = memoryview(data)
        while src:
            dst = self.view()
            if dst is None:
                await self.wait_space()
                continue
            k = min(len(dst), len(src))
            dst[:k] = src[:k]
            src = src[k:]
            self.advance(k)
        if self.error is not None:
            raise WriteFailed

    async def wait_space(self) -> None:
        self.space.clear()
        while not self.free and self.made >= RING:
            await self.space.wait()
            self.space.clear()
        if self.error is not None:
            raise WriteFailed

    def drop(self) -> None:
        """Forget what the current buffer holds (refused bytes are never written)."""
        self.fill = self.lead

    def submit(self) -> None:
        """Hand the filled part of the current buffer to both threads."""
        mv = self.mv
        if mv is None:
            return
        self.mv = None
        lead, fill = self.lead, self.fill
        if fill == lead:
            self.free.append(mv)
            return
        left = [2]

        def done(_: Future) -> None:
            self.loop.call_soon_threadsafe(back)

        def back() -> None:
            left[0] -= 1
            if not left[0]:  # both threads are done with it
                self.free.append(mv)
                self.space.set()
                if self.on_space is not None:
                    self.on_space()

        self.wx.submit(self._write, mv[lead:fill], self.pos).add_done_callback(done)
        self.hx.submit(self._hash, mv[lead:fill]).add_done_callback(done)
        self.pos += fill - lead

    # --- the threads -----------------------------------------------------------------------

    def _hash(self, view: memoryview) -> None:
        try:
            with view:
                for h in self.hashers:
                    h.update(view)
        except BaseException as exc:
            self.hash_error = exc

    def _write(self, view: memoryview, pos: int) -> None:
        if self.error is not None:
            return  # nothing after a hole
        try:
            with view:
                if self.dfd >= 0:
                    self.dfd = write_direct(self.fd, self.dfd, view, pos, self._wrote)
                else:
                    _write_plain(self.fd, view, pos)
                    self._wrote(len(view))
        except BaseException as exc:
            self.error = exc

    def _wrote(self, n: int) -> None:
        self.written += n

    def _close(self) -> None:
        try:
            if self.error is None:
                os.fsync(self.fd)
        except BaseException as exc:
            self.error = exc
            self.written = 0  # nothing is known to be durable
        finally:
            for fd in (self.fd, self.dfd):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    async def finish(self) -> bool:
        """Write what is buffered, close after every write, wait for every hash; True if
        cancelled meanwhile."""
        self.submit()
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
        if self.hash_error is not None and self.error is None:
            self.error = self.hash_error
            self.written = 0  # the running hash no longer matches the file
        return cancelled


def rehash(path: str, length: int) -> object:
    h = hashlib.sha256()
    buf = bytearray(BATCH)
    with open(path, "rb", buffering=0) as f:
        left = length
        while left:
            k = f.readinto(memoryview(buf)[: min(BATCH, left)])
            if not k:
                break
            h.update(memoryview(buf)[:k])
            left -= k
    return h
