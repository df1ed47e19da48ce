"""How the Publisher reads errors: their one-line reasons, and which protocol codes mean what.

``publish_error_class`` is the only place where the Publisher turns a protocol error code into an
exception class; when ``RemoteError`` grows one subclass per code, only it changes.
"""

from __future__ import annotations

import asyncio

from lorafleet.errors import PublishError, PublishInProgress, RemoteError, VersionConflict
from lorafleet.protocol.errors import ErrorCode

__all__ = ["is_not_found", "publish_error_class", "reason"]


def publish_error_class(exc: BaseException) -> type[PublishError] | None:
    """The ``PublishError`` subclass that the router's refusal ``exc`` stands for, else None.

    ``publish_in_progress``: another holder has the name's lease. ``version_conflict``: the
    compare-and-set of the alias failed, or the version is not newer than the active one.
    """
    if isinstance(exc, RemoteError):
        if exc.code == ErrorCode.PUBLISH_IN_PROGRESS:
            return PublishInProgress
        if exc.code == ErrorCode.VERSION_CONFLICT:
            return VersionConflict
    return None


def is_not_found(exc: BaseException) -> bool:
    """The thing to undo is already gone (an unload or discard that found nothing)."""
    return isinstance(exc, RemoteError) and exc.status == 404


def reason(exc: BaseException) -> str:
    """One line for ``PublishError.failures`` and the warnings."""
    if isinstance(exc, RemoteError):
        return f"{exc.status} {exc.code}: {exc.message}"
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
