"""The byte checks every way into the blob store shares: an upload's PUT, a relayed copy, and a
shared-filesystem registration (``Store.ingest_file``).

A file declares its size and sha-256 before its first byte: more bytes than declared are
refused the moment they arrive, and a complete file must match both. ``what`` names the file
in the message; ``param`` is the error's ``param`` field.
"""

from __future__ import annotations

from lorafleet.errors import DigestMismatch, SizeExceeded, SizeMismatch

__all__ = ["check_complete", "check_digest", "check_room", "check_size"]


def check_room(what: str, received: int, more: int, size: int, param: str | None = None) -> None:
    """Raise ``SizeExceeded`` if ``more`` bytes after ``received`` pass the declared ``size``."""
    if received + more > size:
        raise SizeExceeded(f"{what}: more bytes than the declared size of {size}", param=param)


def check_size(what: str, received: int, size: int, param: str | None = None) -> None:
    """Raise ``SizeMismatch`` unless exactly ``size`` bytes arrived."""
    if received != size:
        raise SizeMismatch(f"{what}: declared {size} bytes, received {received}", param=param)


def check_digest(what: str, actual: str, sha256: str, param: str | None = None) -> None:
    """Raise ``DigestMismatch`` unless the bytes hashed to the declared ``sha256``."""
    if actual != sha256:
        raise DigestMismatch(f"{what}: declared sha256 {sha256}, received {actual}", param=param)


def check_complete(
    what: str, received: int, size: int, actual: str, sha256: str, param: str | None = None
) -> None:
    """``check_size`` then ``check_digest``."""
    check_size(what, received, size, param)
    check_digest(what, actual, sha256, param)
