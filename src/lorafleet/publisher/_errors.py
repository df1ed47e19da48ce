"""How the Publisher reads errors: their one-line reasons, and which refusals end a publication
as themselves (the router's ``PublishInProgress`` and ``VersionConflict``)."""

from __future__ import annotations

import asyncio

from lorafleet.errors import NotFound, PublishError, RemoteError

__all__ = ["is_not_found", "publish_error_class", "reason"]


def publish_error_class(exc: BaseException) -> type[PublishError] | None:
    """The ``PublishError`` subclass that the router's refusal ``exc`` stands for, else None.

    ``publish_in_progress``: another holder has the name's lease. ``version_conflict``: the
    compare-and-set of the alias failed, or the version is not newer than the active one.
    """
    # The router's client raises these classes itself (lorafleet.errors.error_for).
    return type(exc) if isinstance(exc, PublishError) else None


def is_not_found(exc: BaseException) -> bool:
    """The thing to undo is already gone (an unload or discard that found nothing)."""
    return isinstance(exc, NotFound)


def reason(exc: BaseException) -> str:
    """One line for ``PublishError.failures`` and the warnings."""
    if isinstance(exc, RemoteError):
        return f"{exc.status} {exc.code}: {exc.message}"
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
