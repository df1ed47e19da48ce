"""Keep the engine holding what the state DB says it should, without the trainer.

Every ``interval`` seconds: ask the engine what it holds; finish the unloads it did not answer
before (``retiring`` records: engine first, then files); reinstall, under its name's lock, every
desired adapter (loaded or active) that is missing or registered from another path. Readiness is
false while the engine is unreachable or a pass has work left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from lorafleet.agent.adapters import AdapterService
from lorafleet.agent.backends import EngineRejected, EngineUnavailable
from lorafleet.agent.state import StoredAdapter
from lorafleet.protocol.agent import AdapterState

__all__ = ["Reconciler"]

log = logging.getLogger("lorafleet.agent")
_DESIRED = (AdapterState.LOADED, AdapterState.ACTIVE)


class Reconciler:
    def __init__(self, service: AdapterService, interval: float = 0.5) -> None:
        self.service = service
        self.interval = interval
        self.engine_reachable = False
        self.pending = True
        """True until a pass found the engine holding every desired adapter."""
        self.detail: str | None = "starting"
        self._task: asyncio.Task | None = None
        self.max_backoff = 30.0
        self._retry: dict[tuple[str, int], tuple[int, float, str]] = {}
        """(name, version) -> (failures, monotonic time of the next try, the engine's error)."""

    @property
    def ready(self) -> bool:
        return self.engine_reachable and not self.pending

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reconciler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep watching whatever happens
                log.exception("reconcile pass failed")
                self.detail = f"reconcile error: {exc}"
            await asyncio.sleep(self.interval)

    async def run_once(self) -> None:
        svc = self.service
        try:
            held = await svc.backend.list_adapters()
        except EngineUnavailable as exc:
            self.engine_reachable = False
            self.pending = True
            self.detail = str(exc)
            if svc.probe is not None:
                svc.probe.reset()  # a restarted engine gets its baseline measured again
            return
        self.engine_reachable = True
        if await svc.retire_pending():
            held = await svc.backend.list_adapters()
        desired = [i for i in svc.db.all() if i.record.state in _DESIRED]
        keys = {(i.record.name, i.record.version) for i in desired}
        for key in list(self._retry):
            if key not in keys:
                del self._retry[key]  # unloaded or replaced meanwhile
        todo = [i for i in desired if not _held(i, held)]
        if not todo:
            self._retry.clear()
            self.pending = False
            self.detail = None
            return
        # Not "pending" yet: a record seen here without its engine name may be one that an
        # unload is removing right now (engine first, then the record). ``_reinstall`` decides
        # under the name's lock, where that race cannot happen.
        now = time.monotonic()
        for item in todo:
            key = (item.record.name, item.record.version)
            if key in self._retry and self._retry[key][1] > now:
                continue  # backing off
            try:
                await self._reinstall(item)
            except EngineUnavailable as exc:
                self.engine_reachable = False
                self.detail = str(exc)
                return
        # Ready only once a fresh listing confirms it (next pass, or right now).
        try:
            held = await svc.backend.list_adapters()
        except EngineUnavailable:
            return
        missing = [i for i in svc.db.all() if i.record.state in _DESIRED and not _held(i, held)]
        if not missing:
            self.pending = False
            self.detail = None
            return
        failing = [
            f"{r.engine_name}: {self._retry[(r.name, r.version)][2]}"
            for r in (i.record for i in missing)
            if (r.name, r.version) in self._retry
        ]
        if failing:
            self.detail = "engine refuses to reinstall " + "; ".join(failing) + " (retrying)"

    async def _reinstall(self, item: StoredAdapter) -> None:
        svc = self.service
        name, version = item.record.name, item.record.version
        async with svc.locks[name]:
            cur = svc.db.get(name, version)  # re-read: an operation may have changed it
            if cur is None or cur.record.state not in _DESIRED:
                return
            r = cur.record
            held = await svc.backend.list_adapters()
            if _held(cur, held):
                self._retry.pop((name, version), None)
                return
            self.pending = True
            self.detail = f"reinstalling {r.engine_name}"
            try:
                await svc.backend.load(r.engine_name, r.path, replace=r.engine_name in held)
            except EngineRejected as exc:
                # Keep the desired state: the engine should hold it, and the agent stays not
                # ready until it does. The error is recorded and the load retried with backoff.
                n = self._retry.get((name, version), (0, 0.0, ""))[0] + 1
                delay = min(self.max_backoff, self.interval * 2 ** min(n, 16))
                self._retry[(name, version)] = (n, time.monotonic() + delay, str(exc))
                log.error(
                    "engine refused to reinstall %s (attempt %d, next in %.1fs): %s",
                    r.engine_name,
                    n,
                    delay,
                    exc,
                )
                err = f"reinstall refused: {exc}"
                if r.error != err:
                    svc.db.put(StoredAdapter(r.model_copy(update={"error": err}), cur.manifest))
                return
            self._retry.pop((name, version), None)
            if r.error is not None:
                cur = StoredAdapter(r.model_copy(update={"error": None}), cur.manifest)
                svc.db.put(cur)
            svc.metrics.reconciliations.inc()
            log.info("reinstalled %s from %s", r.engine_name, r.path)
            canary = svc.db.canary(name, version)
            if canary is not None:
                # Proven again as at its publication: a reinstall that the engine applies
                # otherwise is recorded as failed, and the router stops routing it here.
                try:
                    await svc.prove_locked(cur, canary)
                except EngineRejected as exc:  # AdapterNotApplied, CanaryMismatch too
                    log.error("reinstalled %s fails its proof: %s", r.engine_name, exc)


def _held(item: StoredAdapter, held: dict[str, str]) -> bool:
    r = item.record
    if r.engine_name not in held:
        return False
    path = held[r.engine_name]
    return not path or path == r.path
