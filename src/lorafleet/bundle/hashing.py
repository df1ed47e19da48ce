"""sha256 over files and buffers, in bounded memory."""

from __future__ import annotations

import hashlib
import os

__all__ = ["CHUNK", "sha256_bytes", "sha256_file"]

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """Return ``(hex digest, size)`` of a file, read once in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
