"""Keep the engine holding what the state DB says it should, without the trainer.

Every ``interval`` seconds: ask the engine what it holds; every desired adapter (loaded or
active) that is missing, or registered from another path, is reinstalled from the store under
its name's lock. Readiness is false while the engine is unreachable or a pass has work left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

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
            return
        self.engine_reachable = True
        todo = [i for i in svc.db.all() if i.record.state in _DESIRED and not _held(i, held)]
        if not todo:
            self.pending = False
            self.detail = None
            return
        self.pending = True
        self.detail = f"reinstalling {len(todo)} adapter(s)"
        for item in todo:
            await self._reinstall(item)
        # Ready only once a fresh listing confirms it (next pass, or right now).
        try:
            held = await svc.backend.list_adapters()
        except EngineUnavailable:
            return
        if all(_held(i, held) for i in svc.db.all() if i.record.state in _DESIRED):
            self.pending = False
            self.detail = None

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
                return
            try:
                await svc.backend.load(r.engine_name, r.path, replace=r.engine_name in held)
            except EngineRejected as exc:
                log.error("engine refused to reinstall %s: %s", r.engine_name, exc)
                failed = r.model_copy(update={"state": AdapterState.FAILED, "error": str(exc)})
                svc.db.put(StoredAdapter(failed, cur.manifest))
                return
            svc.metrics.reconciliations.inc()
            log.info("reinstalled %s from %s", r.engine_name, r.path)


def _held(item: StoredAdapter, held: dict[str, str]) -> bool:
    r = item.record
    if r.engine_name not in held:
        return False
    path = held[r.engine_name]
    return not path or path == r.path
