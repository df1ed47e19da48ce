"""Errors in vLLM's own envelope: ``{"error": {"message", "type", "param", "code"}}``.

The reference engine stands in for vLLM, so it answers like vLLM 0.32 does, not like lorafleet's
services: ``type`` is vLLM's class name ("NotFoundError", "InvalidUserInput", ...) and ``code`` the
numeric HTTP status. Messages go through the same scrubbing vLLM applies (paths become ``<path>``).
"""

from __future__ import annotations

import re

__all__ = [
    "ERROR_SCHEMA",
    "EngineError",
    "error_body",
    "responses",
    "sanitize_message",
    "stream_error",
]


def sanitize_message(message: str) -> str:
    """Strip memory addresses, traceback lines and file paths, as vLLM's ``sanitize_message``."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def error_body(status: int, err_type: str, message: str, param: str | None = None) -> dict:
    """vLLM's ``ErrorResponse.model_dump()`` for one error."""
    return {
        "error": {
            "message": sanitize_message(message),
            "type": err_type,
            "param": param,
            "code": status,
        }
    }


class EngineError(Exception):
    """An error answered in vLLM's envelope; raised by the runtime and the routes alike."""

    def __init__(
        self, status: int, err_type: str, message: str, *, param: str | None = None
    ) -> None:
        self.status = status
        self.err_type = err_type
        self.message = message
        self.param = param
        super().__init__(message)

    def body(self) -> dict:
        return error_body(self.status, self.err_type, self.message, self.param)

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> EngineError:
        return cls(400, "BadRequestError", message, param=param)

    @classmethod
    def invalid_input(cls, message: str) -> EngineError:
        return cls(400, "InvalidUserInput", message)

    @classmethod
    def not_found(cls, message: str, param: str | None = None) -> EngineError:
        return cls(404, "NotFoundError", message, param=param)

    @classmethod
    def internal(cls, message: str) -> EngineError:
        return cls(500, "InternalServerError", message)


def stream_error(exc: BaseException) -> dict:
    """The event a stream that fails after its first byte ends with, as vLLM 0.32 maps it
    (``create_streaming_error_response``): the error's own status, 400 for a ``ValueError``,
    ``TypeError`` or ``OverflowError``, 500 for anything else."""
    if isinstance(exc, EngineError):
        return exc.body()
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return error_body(400, "BadRequestError", str(exc))
    return error_body(500, "InternalServerError", f"{type(exc).__name__}: {exc}")


# --- the OpenAPI document ----------------------------------------------------------------------

ERROR_SCHEMA: dict = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}
"""vLLM's envelope (``code`` the numeric status); SGLang's refusals carry only ``message``."""

_WHY = {
    400: "Invalid request (BadRequestError, InvalidUserInput)",
    404: "No such model, adapter or adapter directory (NotFoundError)",
    500: "vLLM 0.32 refuses to load this adapter (its worker's failure, relayed as a 500)",
    503: "max_loras adapters are loaded already (ServiceUnavailableError)",
}


def responses(*statuses: int, ok: dict | None = None) -> dict[int | str, dict]:
    """``responses=`` for a route: its 200 (``ok``, if not plain JSON) and each error status."""
    out: dict[int | str, dict] = {} if ok is None else {200: ok}
    for status in statuses:
        out[status] = {
            "description": _WHY[status],
            "content": {"application/json": {"schema": ERROR_SCHEMA}},
        }
    return out
