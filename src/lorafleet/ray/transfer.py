"""The object-store transfer: a publication's files are put into Ray's object store once, and
each agent's actor pulls them on its own node and uploads them to its agent over loopback.

Ray moves the objects between nodes (its object manager; a node can fetch from any node that
already holds a copy). The agent verifies each file exactly as for any upload (declared size and
sha-256, under its cap and quota), so a copy damaged anywhere on the way is refused there, and
the publication rolls back like any failed upload. The trainer process must be connected to the
cluster (``ray.init``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from lorafleet.errors import error_for
from lorafleet.publisher.carrier import Plan, ReplicaTxn

__all__ = ["ObjectStoreCarrier"]


def _read(plan: Plan, path: str) -> bytes:
    with plan.bundle.open(path) as f:
        return f.read()


class ObjectStoreCarrier:
    """A ``lorafleet.publisher.carrier.Carrier`` over a Ray fleet's agent actors: agent URL ->
    actor name, in ``namespace``. ``RayFleet.publisher()`` passes one as ``object_store``."""

    def __init__(self, agents: Mapping[str, str], namespace: str) -> None:
        self.agents = {url.rstrip("/"): name for url, name in agents.items()}
        self.namespace = namespace

    async def __call__(
        self, plan: Plan, replicas: Sequence[ReplicaTxn]
    ) -> Mapping[str, BaseException]:
        t = time.perf_counter()
        failed: dict[str, BaseException] = {}
        opened = await asyncio.gather(*(r.open() for r in replicas), return_exceptions=True)
        for rep, out in zip(replicas, opened, strict=True):
            if isinstance(out, BaseException):
                failed[rep.id] = out
        if failed:
            return failed
        needed = sorted({p for r in replicas for p in r.missing})
        # One copy into the object store, whatever the number of replicas.
        refs = {p: await asyncio.to_thread(ray.put, _read(plan, p)) for p in needed}

        async def pull(rep: ReplicaTxn) -> list[dict[str, Any]]:
            if not rep.missing:
                return []
            actor = ray.get_actor(self.agents[rep.agent.url], namespace=self.namespace)
            entries = [plan.bundle.manifest.file(p).model_dump() for p in rep.missing]
            mine = {p: refs[p] for p in rep.missing}
            return await actor.pull.remote(mine, rep.upload_id, entries)

        results = await asyncio.gather(*(pull(r) for r in replicas), return_exceptions=True)
        for rep, out in zip(replicas, results, strict=True):
            rep.timing.upload_s = time.perf_counter() - t
            if isinstance(out, BaseException):
                failed[rep.id] = out
                continue
            for got in out:
                if not got.get("complete"):
                    code = got.get("code") or "http_error"
                    failed[rep.id] = error_for(code, got.get("message", code), status=got["status"])
                    break
            else:
                sizes = (plan.bundle.manifest.file(p).size for p in rep.missing)
                rep.timing.bytes_relayed = sum(sizes)
        return failed
