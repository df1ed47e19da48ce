"""The error envelope every lorafleet service answers with, and its stable code table.

The body is vLLM's envelope, ``{"error": {"message", "type", "param", "code"}}``.
``code`` is a stable
string; the same string is sent in the ``X-Lorafleet-Error-Code`` header.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel

__all__ = [
    "ERROR_CODE_HEADER",
    "STATUS_BY_CODE",
    "ErrorCode",
    "ErrorInfo",
    "ErrorResponse",
    "error_body",
]

ERROR_CODE_HEADER = "X-Lorafleet-Error-Code"


class ErrorCode(StrEnum):
    """Stable error codes, each with its one HTTP status: a new code is one line here (and its
    exception class in ``lorafleet.errors``); the status table, the error docs and every route's
    documented statuses are derived from it."""

    status: int

    def __new__(cls, value: str, status: int) -> ErrorCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        return member

    INVALID_REQUEST = "invalid_request", 400
    INVALID_NAME = "invalid_name", 400
    UNAUTHORIZED = "unauthorized", 401
    FORBIDDEN = "forbidden", 403
    NOT_FOUND = "not_found", 404
    UPLOAD_NOT_FOUND = "upload_not_found", 404
    ADAPTER_NOT_FOUND = "adapter_not_found", 404
    VERSION_NOT_ROUTABLE = "version_not_routable", 404
    STALE_VERSION = "stale_version", 409
    FILE_NOT_ALLOWED = "file_not_allowed", 400
    PATH_ESCAPE = "path_escape", 400
    PATH_NOT_ALLOWED = "path_not_allowed", 403
    ADAPTER_CONFLICT = "adapter_conflict", 409
    VERSION_CONFLICT = "version_conflict", 409
    PUBLISH_IN_PROGRESS = "publish_in_progress", 409
    UPLOAD_INCOMPLETE = "upload_incomplete", 409
    OFFSET_MISMATCH = "offset_mismatch", 409
    FILE_TOO_LARGE = "file_too_large", 413
    BODY_TOO_LARGE = "body_too_large", 413
    SIZE_EXCEEDED = "size_exceeded", 413
    QUOTA_EXCEEDED = "quota_exceeded", 507
    SIZE_MISMATCH = "size_mismatch", 422
    DIGEST_MISMATCH = "digest_mismatch", 422
    ADAPTER_INVALID = "adapter_invalid", 422
    ENGINE_REJECTED = "engine_rejected", 502
    ADAPTER_NOT_APPLIED = "adapter_not_applied", 502
    CANARY_MISMATCH = "canary_mismatch", 502
    ENGINE_UNAVAILABLE = "engine_unavailable", 503
    NO_REPLICA = "no_replica", 503
    ADAPTER_COLD = "adapter_cold", 503
    TABLE_STALE = "table_stale", 503
    UNKNOWN_REPLICA = "unknown_replica", 409
    NO_ROOM = "no_room", 409
    TENANT_QUOTA_EXCEEDED = "tenant_quota_exceeded", 409
    STREAM_INTERRUPTED = "stream_interrupted", 502
    TRANSFER_STALLED = "transfer_stalled", 408
    INTERNAL = "internal_error", 500


STATUS_BY_CODE: dict[str, int] = {code.value: code.status for code in ErrorCode}
"""code -> HTTP status, for clients that hold a code as a plain string."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(code: str, message: str, param: str | None = None) -> dict:
    """The JSON body for an error with this code."""
    status = STATUS_BY_CODE.get(code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ErrorResponse(
        error=ErrorInfo(message=message, type=kind, param=param, code=code)
    ).model_dump()
