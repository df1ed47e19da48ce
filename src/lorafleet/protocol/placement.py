"""Where a version goes: the rule the Publisher (a placement set) and the router (an on-demand
load) share, so that both pick the same replicas for a name (``docs/placement.md``)."""

from __future__ import annotations

import hashlib

__all__ = ["rendezvous"]


def rendezvous(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` ordered by highest random weight for ``key`` (rendezvous hashing): a
    replica that joins or leaves moves only the keys it ranks first for, and every caller that
    knows the same replicas ranks them the same way."""

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)
