"""RFC 9530 digest fields (``Repr-Digest``, ``Content-Digest``) as the agent reads them."""

from __future__ import annotations

import base64
import binascii

from lorafleet.errors import InvalidRequest

__all__ = ["parse_sha256_digest"]


def parse_sha256_digest(value: str, header: str) -> str:
    """Hex sha256 from an RFC 9530 dictionary value such as ``sha-256=:<base64>:``."""
    for item in value.split(","):
        key, _, val = item.strip().partition("=")
        if key.strip().lower() == "sha-256":
            val = val.strip()
            if len(val) >= 2 and val[0] == ":" and val[-1] == ":":
                try:
                    raw = base64.b64decode(val[1:-1], validate=True)
                except (binascii.Error, ValueError):
                    break
                if len(raw) == 32:
                    return raw.hex()
            break
    raise InvalidRequest(f"{header} needs a sha-256=:<base64>: member", param=header)
