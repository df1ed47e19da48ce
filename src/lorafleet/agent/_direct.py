"""O_DIRECT writes of one large file from the receive buffers, past the page cache.

Copying every received byte into the page cache cost the agent more CPU than hashing it
(bench/RESULTS.md); a direct write is a DMA. Small files stay in the page cache for the engine
that loads them next; a file system that refuses O_DIRECT gets ordinary writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable

__all__ = ["ALIGN", "open_direct", "write_direct"]

ALIGN = 4096  # O_DIRECT: buffer address, length and file offset are multiples of this


def open_direct(path: str) -> int:
    """An O_DIRECT descriptor for writing ``path``, or -1 where there is none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1  # not Linux
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return -1  # a file system without O_DIRECT: the page cache it is


def _plain(fd: int, view: memoryview, pos: int, wrote: Callable[[int], None]) -> None:
    while view:
        n = os.pwrite(fd, view, pos)
        wrote(n)
        view, pos = view[n:], pos + n


def write_direct(
    fd: int, dfd: int, view: memoryview, pos: int, wrote: Callable[[int], None]
) -> int:
    """Write ``view`` at ``pos``: whole aligned blocks through ``dfd``, the partial blocks at
    either end (an unaligned resume, the file's tail) through ``fd``. ``view``'s address must
    match ``pos`` modulo ``ALIGN``. ``wrote(n)`` follows each write, in file order. Returns the
    direct descriptor to use next: -1 once the file system refused a direct write."""
    n = len(view)
    head = min(n, -pos % ALIGN)
    body = (n - head) - (n - head) % ALIGN
    _plain(fd, view[:head], pos, wrote)
    done = head
    if body and dfd >= 0:
        try:
            while done < head + body:
                k = os.pwrite(dfd, view[done : head + body], pos + done)
                wrote(k)
                done += k
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            with contextlib.suppress(OSError):
                os.close(dfd)  # alignment this file system will not take
            dfd = -1
    _plain(fd, view[done:], pos + done, wrote)
    return dfd
