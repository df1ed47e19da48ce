"""``Runtime``: everything one agent process holds, built at startup and torn down at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_fixed

from lorafleet.agent.adapters import AdapterService
from lorafleet.agent.backends import EngineBackend, EngineUnavailable, make_backend
from lorafleet.agent.config import AgentConfig
from lorafleet.agent.metrics import Metrics
from lorafleet.agent.probe import ApplicationProbe
from lorafleet.agent.reconcile import Reconciler
from lorafleet.agent.state import StateDB
from lorafleet.agent.store import Store
from lorafleet.agent.uploads import UploadManager
from lorafleet.protocol.agent import (
    EngineCapabilities,
    Health,
)

__all__ = ["Runtime"]

log = logging.getLogger("lorafleet.agent")


class Runtime:
    """Everything one agent process holds, built at startup and torn down at shutdown."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.store = Store(cfg.data_dir)
        removed = self.store.clear_staging()
        if removed:
            log.info("removed %d stale staging entries", removed)
        self.db = StateDB(self.store.root / "state.db")
        swept = self.store.sweep({(i.record.name, i.record.version) for i in self.db.all()})
        if swept:
            log.info("removed %d orphaned adapter directories and blobs", swept)
        self.store.blob_bytes()  # count once now; kept up to date from here on
        self.uploads = UploadManager(self.store, cfg.limits, self.metrics)
        self.backend: EngineBackend = make_backend(
            cfg.engine,
            cfg.engine_url,
            max_lora_rank=cfg.max_lora_rank,
            max_adapters=cfg.max_adapters,
            options=cfg.engine_options,
        )
        self.caps = EngineCapabilities(kind=cfg.engine)
        self.base_model = cfg.served_model_name or "unknown"
        self.probed = False
        self.probe_detail: str | None = "engine not probed yet"
        self.service = AdapterService(
            self.store,
            self.db,
            self.uploads,
            self.backend,
            self.caps,
            self.metrics,
            cfg.shared_fs_allow,
        )
        self.reconciler = Reconciler(self.service, cfg.reconcile_interval)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._probe_until_ok(), name="probe"))
        self._tasks.append(asyncio.create_task(self._reap_forever(), name="reaper"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.reconciler.stop()
        await self.uploads.aclose_relay()
        await self.backend.aclose()
        self.db.close()

    async def _probe_until_ok(self) -> None:
        """Probe the engine until it answers; a garbled answer must not end probing for good."""

        def note(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, EngineUnavailable):
                self.probe_detail = str(exc)
            else:
                log.warning("engine probe failed: %s: %s", type(exc).__name__, exc)
                self.probe_detail = f"engine probe failed: {type(exc).__name__}: {exc}"

        retrying = AsyncRetrying(
            wait=wait_fixed(0.5), retry=retry_if_exception_type(Exception), before_sleep=note
        )
        probe = await retrying(self.backend.probe)
        self.caps = probe.capabilities
        self.service.caps = probe.capabilities
        if not self.cfg.served_model_name:
            self.base_model = probe.base_model
        self.service.probe = ApplicationProbe(self.backend.http, self.caps.kind, self.base_model)
        # The base model's logprobs, measured now: a vLLM server's first prompt-logprobs
        # request can take tens of seconds, which belongs to startup, not to a publication.
        self._tasks.append(asyncio.create_task(self._warm_probe(), name="probe-baseline"))
        self.probed = True
        self.probe_detail = None
        self.reconciler.start()

    async def _warm_probe(self) -> None:
        try:
            await self.service.probe.baseline()
        except Exception as exc:  # measured again on the first check
            log.warning("application probe baseline failed: %s", exc)

    async def _reap_forever(self) -> None:
        period = max(0.2, min(self.cfg.limits.ttl_s / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            try:
                await self.uploads.areap()
            except Exception:
                log.exception("reaping uploads failed")

    def health(self) -> Health:
        rec = self.reconciler
        if not self.probed:
            return Health(
                status="not_ready",
                engine_reachable=False,
                reconciling=True,
                detail=self.probe_detail,
            )
        return Health(
            status="ok" if rec.ready else "not_ready",
            engine_reachable=rec.engine_reachable,
            reconciling=rec.pending,
            detail=rec.detail,
        )
