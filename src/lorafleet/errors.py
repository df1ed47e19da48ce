"""The lorafleet exception tree. Every error lorafleet raises is a ``LorafleetError``.

LorafleetError
├── BundleError                   a bundle or adapter directory is unusable (trainer side)
│   └── ManifestInvalid           the manifest itself is malformed (names, paths, sizes)
├── TransportError                no response came back (connect, timeout); retryable
├── ServiceError                  an error with a protocol code (alias: RemoteError)
│   │     .code .status .message .param .headers, and .url when a client received it
│   ├── InvalidRequest            400 invalid_request (also a ValueError: validators raise it)
│   │   ├── InvalidName           400 invalid_name          (lorafleet.protocol.names's rule)
│   │   └── PathError             a bundle file path is unsafe or not allowed (``.kind``)
│   │       ├── FileNotAllowed    400 file_not_allowed
│   │       └── PathEscape        400 path_escape
│   ├── Unauthorized              401 unauthorized
│   ├── Forbidden                 403 forbidden
│   │   └── PathNotAllowed        403 path_not_allowed
│   ├── NotFound                  404 not_found
│   │   ├── UploadNotFound        404 upload_not_found
│   │   ├── AdapterNotFound       404 adapter_not_found
│   │   └── VersionNotRoutable    404 version_not_routable  (outside the retention window)
│   ├── TransferStalled           408 transfer_stalled      (a relayed PUT stopped sending)
│   ├── Conflict                  409
│   │   ├── AdapterConflict       409 adapter_conflict
│   │   ├── NoRoom                409 no_room               (a full engine, nothing evictable)
│   │   ├── TenantQuotaExceeded   409 tenant_quota_exceeded (a tenant's max_adapters/max_bytes)
│   │   ├── UploadIncomplete      409 upload_incomplete
│   │   ├── OffsetMismatch        409 offset_mismatch
│   │   ├── StaleVersion          409 stale_version         (older than max_staleness allows)
│   │   ├── UnknownReplica        409 unknown_replica       (an alias names a replica not known)
│   │   ├── VersionConflict       409 version_conflict      (also a PublishError)
│   │   └── PublishInProgress     409 publish_in_progress   (also a PublishError)
│   ├── TooLarge                  413
│   │   ├── FileTooLarge          413 file_too_large
│   │   ├── BodyTooLarge          413 body_too_large
│   │   └── SizeExceeded          413 size_exceeded
│   ├── IntegrityError            422 received bytes differ from what was declared
│   │   ├── SizeMismatch          422 size_mismatch
│   │   └── DigestMismatch        422 digest_mismatch
│   ├── AdapterInvalid            422 adapter_invalid       (also a BundleError; .problems)
│   ├── InternalError             500 internal_error
│   ├── EngineRejected            502 engine_rejected
│   │   ├── AdapterNotApplied     502 adapter_not_applied   (loaded, but outputs are the base's)
│   │   ├── CanaryMismatch        502 canary_mismatch       (applied, not as the trainer computed)
│   │   └── StreamInterrupted     502 stream_interrupted    (an engine's stream broke mid-way)
│   ├── Unavailable               503
│   │   ├── EngineUnavailable     503 engine_unavailable
│   │   ├── NoReplica             503 no_replica
│   │   ├── AdapterCold           503 adapter_cold          (placed nowhere; being loaded)
│   │   └── TableStale            503 table_stale
│   └── QuotaExceeded             507 quota_exceeded
└── PublishError                  a publication failed; ``.failures`` maps replica -> reason

Servers raise these from their logic; one mapper per side turns them into the wire envelope
(``lorafleet._service``) and back (``error_for``, used by ``lorafleet._http.raise_for_status``).
A code without a class of its own maps to its status's family (``Conflict`` for 409, ...), so
adding a code touches ``lorafleet.protocol.errors`` and the raising site only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from lorafleet.protocol.errors import STATUS_BY_CODE as _STATUS_BY_CODE
from lorafleet.protocol.errors import ErrorCode

__all__ = [
    "AdapterCold",
    "AdapterConflict",
    "AdapterInvalid",
    "AdapterNotApplied",
    "AdapterNotFound",
    "BodyTooLarge",
    "BundleError",
    "CanaryMismatch",
    "Conflict",
    "DigestMismatch",
    "EngineRejected",
    "EngineUnavailable",
    "ErrorCode",
    "FileNotAllowed",
    "FileTooLarge",
    "Forbidden",
    "InstallFailed",
    "IntegrityError",
    "InternalError",
    "InvalidName",
    "InvalidRequest",
    "LorafleetError",
    "ManifestInvalid",
    "NoReplica",
    "NoRoom",
    "NotFound",
    "OffsetMismatch",
    "PathError",
    "PathEscape",
    "PathNotAllowed",
    "PublishError",
    "PublishInProgress",
    "QuotaExceeded",
    "RemoteError",
    "ServiceError",
    "SizeExceeded",
    "SizeMismatch",
    "StaleVersion",
    "StreamInterrupted",
    "TableStale",
    "TenantQuotaExceeded",
    "TooLarge",
    "TransferStalled",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnknownReplica",
    "UploadIncomplete",
    "UploadNotFound",
    "VersionConflict",
    "VersionNotRoutable",
    "error_for",
]


class LorafleetError(Exception):
    """Root of every error lorafleet raises.

    Pickles by class, ``args`` and attributes, never by calling a constructor (several take
    keyword-only arguments plain pickling cannot pass), so that an error crosses a process
    boundary whole: a Ray actor's, a rank's in ``integrations.distributed``.
    """

    def __reduce__(self):
        return _rebuild_exception, (type(self), self.args, dict(vars(self)))


def _rebuild_exception(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    """An instance of ``cls`` with these args and attributes, built without its constructor
    (whose signature need not match ``args``)."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class BundleError(LorafleetError):
    """A bundle or adapter directory cannot be published."""


class ManifestInvalid(BundleError):
    """The manifest is malformed: a bad name, path, size or digest field."""


class TransportError(LorafleetError):
    """No response came back (connection refused or reset, timeout). Safe to retry if idempotent."""


_BY_CODE: dict[str, type[ServiceError]] = {}
_BY_STATUS: dict[int, type[ServiceError]] = {}


class ServiceError(LorafleetError):
    """An error with a stable protocol code; its HTTP status follows from the code.

    Raised by service logic (the agent, the router); a client raises the same class from an
    error answer, with ``url`` and the answered ``status`` set.
    """

    code: ClassVar[str | None] = None
    family_status: ClassVar[int | None] = None
    """Set on family classes: the status whose unknown codes map to this class."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        status: int | None = None,
        url: str | None = None,
    ) -> None:
        code = code or type(self).code
        if not code:
            raise TypeError(f"{type(self).__name__} needs an explicit protocol code")
        self.code: str = code  # type: ignore[misc]
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        self._status = status
        self.url = url
        super().__init__(message)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "code" in cls.__dict__ and cls.code:
            _BY_CODE[cls.code] = cls
        if "family_status" in cls.__dict__ and cls.family_status:
            _BY_STATUS[cls.family_status] = cls

    @property
    def status(self) -> int:
        """The answered status (client side) or the code's status (server side)."""
        if self._status is not None:
            return self._status
        return _STATUS_BY_CODE.get(self.code, self.family_status or 500)

    def __str__(self) -> str:
        if self.url:
            return f"{self.status} {self.code} from {self.url}: {self.message}"
        return self.message

    @classmethod
    def _from_wire(cls, message: str, **kw: Any) -> ServiceError:
        """An instance built from an error answer, whatever the subclass's own signature."""
        self = cls.__new__(cls)
        ServiceError.__init__(self, message, **kw)
        return self


RemoteError = ServiceError
"""The name clients catch for "a lorafleet service or engine answered with an error"."""


def error_for(
    code: str,
    message: str,
    *,
    status: int,
    url: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> ServiceError:
    """The most specific ``ServiceError`` for an error answer (client-side mapper)."""
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status) or ServiceError
    return cls._from_wire(message, code=code, status=status, url=url, param=param, headers=headers)


# --- 400 -----------------------------------------------------------------------------------


class InvalidRequest(ServiceError, ValueError):
    """The request is malformed. A ``ValueError`` too, so that pydantic validators raise it."""

    code = ErrorCode.INVALID_REQUEST
    family_status = 400


class InvalidName(InvalidRequest):
    """A name, engine name, lease holder or model outside ``lorafleet.protocol.names``'s rule."""

    code = ErrorCode.INVALID_NAME


class PathError(InvalidRequest):
    """A bundle file path that may not be written: ``kind`` is ``escape`` or ``not_allowed``."""

    kind: ClassVar[str]

    def __init__(self, message: str, *, path: str) -> None:
        self.path = path
        super().__init__(message, param=path)


class FileNotAllowed(PathError):
    """A file name outside the allow-list."""

    code = ErrorCode.FILE_NOT_ALLOWED
    kind = "not_allowed"


class PathEscape(PathError):
    """An absolute path, ``..`` or another escape from the adapter directory."""

    code = ErrorCode.PATH_ESCAPE
    kind = "escape"


# --- 401 / 403 -----------------------------------------------------------------------------


class Unauthorized(ServiceError):
    """No credentials (or not a bearer token)."""

    code = ErrorCode.UNAUTHORIZED
    family_status = 401


class Forbidden(ServiceError):
    """Credentials were given and are wrong."""

    code = ErrorCode.FORBIDDEN
    family_status = 403


class PathNotAllowed(Forbidden):
    """A shared-filesystem path outside the agent's allow-list."""

    code = ErrorCode.PATH_NOT_ALLOWED


# --- 404 -----------------------------------------------------------------------------------


class NotFound(ServiceError):
    code = ErrorCode.NOT_FOUND
    family_status = 404


class UploadNotFound(NotFound):
    code = ErrorCode.UPLOAD_NOT_FOUND


class AdapterNotFound(NotFound):
    code = ErrorCode.ADAPTER_NOT_FOUND


class VersionNotRoutable(NotFound):
    """A pinned version (``name@vN``, or a session's) is not in the name's retention window."""

    code = ErrorCode.VERSION_NOT_ROUTABLE


# --- 409 -----------------------------------------------------------------------------------


class TransferStalled(ServiceError):
    """A relayed upload received no byte for its stall limit; its durable prefix stays."""

    code = ErrorCode.TRANSFER_STALLED


class Conflict(ServiceError):
    """The request clashes with the current state."""

    family_status = 409


class AdapterConflict(Conflict):
    """Another record is in the way (same name and version with other bytes, or another mode)."""

    code = ErrorCode.ADAPTER_CONFLICT


class UploadIncomplete(Conflict):
    code = ErrorCode.UPLOAD_INCOMPLETE


class StaleVersion(Conflict):
    """A pinned version is older than the newest by more than the name's ``max_staleness``."""

    code = ErrorCode.STALE_VERSION


class OffsetMismatch(Conflict):
    """A PUT did not start at the durable offset (sent in the ``Upload-Offset`` header)."""

    code = ErrorCode.OFFSET_MISMATCH


class NoRoom(Conflict):
    """A replica's engine is full and nothing on it could be evicted (every adapter is in use by
    a publication, asked to be kept, or did not drain in time)."""

    code = ErrorCode.NO_ROOM


class UnknownReplica(Conflict):
    """An alias names a replica the router does not know (no agent of its reports that id)."""

    code = ErrorCode.UNKNOWN_REPLICA


class TenantQuotaExceeded(Conflict):
    """A load would take a tenant past one of its quotas (``lorafleet.protocol.tenants``):
    ``quota`` names which (``max_adapters``, ``max_bytes``, ``max_slots``), ``limit`` is the
    tenant's bound and ``usage`` what it would hold. A 409, not the store's 507: retiring one of
    the tenant's own adapters resolves it, and no disk is short."""

    code = ErrorCode.TENANT_QUOTA_EXCEEDED

    def __init__(self, message: str, *, quota: str, limit: int, usage: int) -> None:
        self.quota = quota
        self.limit = limit
        self.usage = usage
        super().__init__(message, param=quota)

    @classmethod
    def _from_wire(cls, message: str, **kw: Any) -> ServiceError:
        self = super()._from_wire(message, **kw)
        # The figures travel in the message; the quota's name in ``param``.
        self.quota, self.limit, self.usage = kw.get("param"), None, None  # type: ignore[attr-defined]
        return self


# --- 413 / 422 / 5xx / 507 -------------------------------------------------------------------


class TooLarge(ServiceError):
    family_status = 413


class FileTooLarge(TooLarge):
    """A declared file is over the per-file cap."""

    code = ErrorCode.FILE_TOO_LARGE


class BodyTooLarge(TooLarge):
    code = ErrorCode.BODY_TOO_LARGE


class SizeExceeded(TooLarge):
    """More bytes arrived than the manifest declared."""

    code = ErrorCode.SIZE_EXCEEDED


class IntegrityError(ServiceError):
    """Received bytes do not match the declared size or digest."""

    family_status = 422


class SizeMismatch(IntegrityError):
    code = ErrorCode.SIZE_MISMATCH


class DigestMismatch(IntegrityError):
    code = ErrorCode.DIGEST_MISMATCH


class AdapterInvalid(BundleError, ServiceError):
    """Validation found one or more problems; ``problems`` holds one message per problem."""

    code = ErrorCode.ADAPTER_INVALID

    def __init__(self, problems: Sequence[str], path: str | None = None) -> None:
        self.problems = list(problems)
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(where + "; ".join(self.problems))

    @classmethod
    def _from_wire(cls, message: str, **kw: Any) -> ServiceError:
        self = super()._from_wire(message, **kw)
        self.problems, self.path = [message], None  # type: ignore[attr-defined]
        return self


class InternalError(ServiceError):
    code = ErrorCode.INTERNAL
    family_status = 500


class EngineRejected(ServiceError):
    """The engine answered and refused; the message is the engine's own text."""

    code = ErrorCode.ENGINE_REJECTED
    family_status = 502

    def __init__(self, message: str, engine_status: int | None = None) -> None:
        self.engine_status = engine_status
        super().__init__(message)

    @classmethod
    def _from_wire(cls, message: str, **kw: Any) -> ServiceError:
        self = super()._from_wire(message, **kw)
        self.engine_status = None  # type: ignore[attr-defined]
        return self


class AdapterNotApplied(EngineRejected):
    """The engine took the adapter but answers as the base model when asked for it."""

    code = ErrorCode.ADAPTER_NOT_APPLIED


class CanaryMismatch(EngineRejected):
    """The engine applies the adapter, but its log-probabilities on the trainer's canary are
    not the trainer's (``lorafleet.protocol.canary``); the message has the figures."""

    code = ErrorCode.CANARY_MISMATCH


class StreamInterrupted(ServiceError):
    """An engine's stream broke, or ended without ``[DONE]``, after its first byte was sent."""

    code = ErrorCode.STREAM_INTERRUPTED


class Unavailable(ServiceError):
    """Nothing can serve the request right now; worth retrying later."""

    family_status = 503


class EngineUnavailable(Unavailable):
    """The engine did not answer, or is not set up for runtime LoRA."""

    code = ErrorCode.ENGINE_UNAVAILABLE


class NoReplica(Unavailable):
    code = ErrorCode.NO_REPLICA


class AdapterCold(Unavailable):
    """The version is placed on no replica and its on-demand load did not finish within the
    bound: ``Retry-After`` says when to ask again (the load goes on)."""

    code = ErrorCode.ADAPTER_COLD


class TableStale(Unavailable):
    """A data-plane copy was cut off from the control plane long enough to have missed a flip
    (it was frozen, or starved): it answers no adapter request until it has the table again."""

    code = ErrorCode.TABLE_STALE


class QuotaExceeded(ServiceError):
    """The store cannot take the bytes (quota, or free disk)."""

    code = ErrorCode.QUOTA_EXCEEDED
    family_status = 507


# --- publication ---------------------------------------------------------------------------


class InstallFailed(LorafleetError):
    """Installing a version on a replica failed where the agent reported nothing itself (a peer
    could not send every file, the engine proved other bytes); the message says which and why."""


class PublishError(LorafleetError):
    """A publication failed. ``failures`` maps each failing replica to its reason."""

    def __init__(
        self, message: str, failures: Mapping[str, str] | None = None, **service: Any
    ) -> None:
        self.failures = dict(failures or {})
        detail = "".join(f"\n  - {replica}: {why}" for replica, why in self.failures.items())
        super().__init__(message + detail, **service)

    @classmethod
    def _from_wire(cls, message: str, **kw: Any) -> ServiceError:
        self = super()._from_wire(message, **kw)  # type: ignore[misc]
        self.failures = {}
        return self


class VersionConflict(PublishError, Conflict):
    """The version is not newer than the active one (or the compare-and-set failed)."""

    code = ErrorCode.VERSION_CONFLICT


class PublishInProgress(PublishError, Conflict):
    """Another publisher holds this name."""

    code = ErrorCode.PUBLISH_IN_PROGRESS
