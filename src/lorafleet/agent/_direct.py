"""O_DIRECT writes of one large file from an aligned buffer, past the page cache.

Copying every received byte into the page cache cost the agent more CPU than hashing it
(bench/RESULTS.md); a direct write is a DMA. Small files stay in the page cache for the engine
that loads them next; a file system that refuses O_DIRECT gets ordinary writes.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os

__all__ = ["ALIGN", "DirectWriter"]

ALIGN = 4096  # O_DIRECT: buffer address, length and file offset are multiples of this
_DIRECT_BUF = 4 << 20  # the aligned buffer a direct write goes out of


class DirectWriter:
    """Writes one file's bytes with O_DIRECT from an aligned buffer (write thread only).

    Bytes are copied into a page-aligned buffer and written in aligned runs through a second,
    O_DIRECT descriptor; what does not fill an aligned block (an unaligned resume offset, the
    file's tail) goes through the ordinary descriptor. ``pos`` is the file offset up to which
    bytes have been written. If the file system refuses a direct write, the rest of the file
    is written through the page cache.
    """

    def __init__(self, fd: int, dfd: int, pos: int) -> None:
        self.fd, self.dfd = fd, dfd
        self.start = self.pos = pos
        self.buf = mmap.mmap(-1, _DIRECT_BUF)  # page-aligned
        self.fill = 0

    @classmethod
    def open(cls, path: str, fd: int, pos: int) -> DirectWriter | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None  # not Linux
        try:
            dfd = os.open(path, os.O_WRONLY | flag)
        except OSError:
            return None  # a file system without O_DIRECT: the page cache it is
        return cls(fd, dfd, pos)

    def write(self, parts: list[bytes]) -> None:
        for p in parts:
            mv = memoryview(p)
            while mv:
                take = min(len(mv), len(self.buf) - self.fill)
                self.buf[self.fill : self.fill + take] = mv[:take]
                self.fill += take
                mv = mv[take:]
                if self.fill == len(self.buf):
                    self._flush()
        self._flush()

    def _flush(self) -> None:
        head = -self.pos % ALIGN
        if head and self.fill:  # reach an aligned offset first (a resume mid-block)
            self._plain(min(head, self.fill))
        run = self.fill - self.fill % ALIGN
        if not run:
            return
        if self.dfd < 0:
            self._plain(run)
            return
        with memoryview(self.buf) as view:
            done = 0
            try:
                while done < run:
                    done += os.pwrite(self.dfd, view[done:run], self.pos + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.dfd)  # alignment this file system will not take
                self.dfd = -1
        self._consume(done)
        if done < run:
            self._plain(run - done)

    def _plain(self, n: int) -> None:
        with memoryview(self.buf) as view:
            done = 0
            while done < n:
                done += os.pwrite(self.fd, view[done:n], self.pos + done)
        self._consume(n)

    def _consume(self, n: int) -> None:
        self.pos += n
        self.fill -= n
        if self.fill:
            self.buf.move(0, n, self.fill)

    def flush_tail(self) -> None:
        """Write what is left (less than a block, or everything after a direct refusal)."""
        self._flush()
        if self.fill:
            self._plain(self.fill)

    def close(self) -> None:
        if self.dfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.dfd)
            self.dfd = -1
        self.buf.close()
