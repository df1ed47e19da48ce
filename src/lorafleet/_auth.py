"""Bearer-token checks, shared by every lorafleet service and the reference engine.

One parser and one constant-time comparison; each caller turns the verdict into its own answer
(lorafleet's error envelope, or vLLM's ``{"error": "Unauthorized"}`` in the reference engine).
"""

from __future__ import annotations

import hmac
from typing import Literal

__all__ = ["BearerVerdict", "check_bearer"]

BearerVerdict = Literal["ok", "missing", "invalid"]


def check_bearer(authorization: str | bytes | None, expected: str | bytes) -> BearerVerdict:
    """Judge an ``Authorization`` header against the expected bearer token.

    ``missing``: no header, another scheme, or an empty token. ``invalid``: a bearer token that
    is not ``expected``. The comparison is constant-time.
    """
    if not authorization:
        return "missing"
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    if isinstance(expected, str):
        expected = expected.encode()
    scheme, _, token = authorization.partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return "missing"
    return "ok" if hmac.compare_digest(token, expected) else "invalid"
