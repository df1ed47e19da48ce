"""The error envelope every lorafleet service answers with, and its stable code table.

The body is vLLM's envelope, ``{"error": {"message", "type", "param", "code"}}``.
``code`` is a stable
string; the same string is sent in the ``X-Lorafleet-Error-Code`` header.
"""

from __future__ import annotations

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


class ErrorCode:
    """Stable error codes. Each maps to exactly one HTTP status in ``STATUS_BY_CODE``."""

    INVALID_REQUEST = "invalid_request"
    INVALID_NAME = "invalid_name"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    UPLOAD_NOT_FOUND = "upload_not_found"
    ADAPTER_NOT_FOUND = "adapter_not_found"
    VERSION_NOT_ROUTABLE = "version_not_routable"
    STALE_VERSION = "stale_version"
    FILE_NOT_ALLOWED = "file_not_allowed"
    PATH_ESCAPE = "path_escape"
    PATH_NOT_ALLOWED = "path_not_allowed"
    ADAPTER_CONFLICT = "adapter_conflict"
    VERSION_CONFLICT = "version_conflict"
    PUBLISH_IN_PROGRESS = "publish_in_progress"
    UPLOAD_INCOMPLETE = "upload_incomplete"
    OFFSET_MISMATCH = "offset_mismatch"
    FILE_TOO_LARGE = "file_too_large"
    BODY_TOO_LARGE = "body_too_large"
    SIZE_EXCEEDED = "size_exceeded"
    QUOTA_EXCEEDED = "quota_exceeded"
    SIZE_MISMATCH = "size_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    ADAPTER_INVALID = "adapter_invalid"
    ENGINE_REJECTED = "engine_rejected"
    ADAPTER_NOT_APPLIED = "adapter_not_applied"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    NO_REPLICA = "no_replica"
    UNKNOWN_REPLICA = "unknown_replica"
    STREAM_INTERRUPTED = "stream_interrupted"
    TRANSFER_STALLED = "transfer_stalled"
    INTERNAL = "internal_error"


STATUS_BY_CODE: dict[str, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_NAME: 400,
    ErrorCode.FILE_NOT_ALLOWED: 400,
    ErrorCode.PATH_ESCAPE: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.PATH_NOT_ALLOWED: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UPLOAD_NOT_FOUND: 404,
    ErrorCode.ADAPTER_NOT_FOUND: 404,
    ErrorCode.VERSION_NOT_ROUTABLE: 404,
    ErrorCode.TRANSFER_STALLED: 408,
    ErrorCode.STALE_VERSION: 409,
    ErrorCode.ADAPTER_CONFLICT: 409,
    ErrorCode.VERSION_CONFLICT: 409,
    ErrorCode.PUBLISH_IN_PROGRESS: 409,
    ErrorCode.UPLOAD_INCOMPLETE: 409,
    ErrorCode.OFFSET_MISMATCH: 409,
    ErrorCode.UNKNOWN_REPLICA: 409,
    ErrorCode.FILE_TOO_LARGE: 413,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.SIZE_EXCEEDED: 413,
    ErrorCode.SIZE_MISMATCH: 422,
    ErrorCode.DIGEST_MISMATCH: 422,
    ErrorCode.ADAPTER_INVALID: 422,
    ErrorCode.ENGINE_REJECTED: 502,
    ErrorCode.ADAPTER_NOT_APPLIED: 502,
    ErrorCode.STREAM_INTERRUPTED: 502,
    ErrorCode.ENGINE_UNAVAILABLE: 503,
    ErrorCode.NO_REPLICA: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.QUOTA_EXCEEDED: 507,
}


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
