"""The lorafleet exception tree. Every error lorafleet raises is a ``LorafleetError``.

LorafleetError
├── BundleError                 a bundle or adapter directory is unusable
│   ├── ManifestInvalid         the manifest itself is malformed (names, paths, sizes)
│   └── AdapterInvalid          validation found problems; ``.problems`` lists each one
├── IntegrityError              bytes do not match what was declared
│   ├── DigestMismatch
│   └── SizeMismatch
├── TransportError              no response came back (connect, timeout); retryable
├── RemoteError                 a lorafleet service or engine answered with an error
│       .status, .code, .message, .url (see protocol.errors for the code table)
└── PublishError                a publication failed; ``.failures`` maps replica -> reason
    ├── VersionConflict         the version is not newer than the active one
    └── PublishInProgress       another publisher holds this name
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "AdapterInvalid",
    "BundleError",
    "DigestMismatch",
    "IntegrityError",
    "LorafleetError",
    "ManifestInvalid",
    "PublishError",
    "PublishInProgress",
    "RemoteError",
    "SizeMismatch",
    "TransportError",
    "VersionConflict",
]


class LorafleetError(Exception):
    """Root of every error lorafleet raises."""


class BundleError(LorafleetError):
    """A bundle or adapter directory cannot be published."""


class ManifestInvalid(BundleError):
    """The manifest is malformed: a bad name, path, size or digest field."""


class AdapterInvalid(BundleError):
    """Validation found one or more problems; ``problems`` holds one message per problem."""

    def __init__(self, problems: Sequence[str], path: str | None = None) -> None:
        self.problems = list(problems)
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(where + "; ".join(self.problems))


class IntegrityError(LorafleetError):
    """Received bytes do not match the declared size or digest."""


class DigestMismatch(IntegrityError):
    """The sha256 of the received bytes differs from the declared one."""


class SizeMismatch(IntegrityError):
    """The number of received bytes differs from the declared size."""


class TransportError(LorafleetError):
    """No response came back (connection refused or reset, timeout). Safe to retry if idempotent."""


class RemoteError(LorafleetError):
    """A lorafleet service or an engine answered with an error status."""

    def __init__(self, status: int, code: str, message: str, url: str | None = None) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.url = url
        at = f" from {url}" if url else ""
        super().__init__(f"{status} {code}{at}: {message}")


class PublishError(LorafleetError):
    """A publication failed. ``failures`` maps each failing replica to its reason."""

    def __init__(self, message: str, failures: Mapping[str, str] | None = None) -> None:
        self.failures = dict(failures or {})
        detail = "".join(f"\n  - {replica}: {why}" for replica, why in self.failures.items())
        super().__init__(message + detail)


class VersionConflict(PublishError):
    """The version being published is not newer than the active one."""


class PublishInProgress(PublishError):
    """Another publisher is publishing this name right now."""
