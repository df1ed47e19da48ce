"""``DataPlane``: one copy of the data plane over an alias table and a replica set.

It owns the upstream connection pools and the pipeline (the hot generation paths). The alias
table is read, never written: in one process it is the control plane's own store; in a
data-plane copy it is the last snapshot the copy acknowledged (``sync.py``). Whoever owns the
replica set (``Balancer``) keeps it current (``health.HealthPoller``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp

from lorafleet.dataplane.addressing import TableView
from lorafleet.dataplane.balancer import Balancer, Replica
from lorafleet.dataplane.metrics import RouterMetrics
from lorafleet.dataplane.pipeline import Gate, Pipeline, Warmer
from lorafleet.dataplane.shapes import HOT_PATHS
from lorafleet.dataplane.upstream import client_session
from lorafleet.protocol.tenants import Tenants

__all__ = ["DataPlane"]


class DataPlane:
    """The hot paths (``pipeline``) and the data plane's own calls (abort, finish a session)."""

    hot_paths = HOT_PATHS

    def __init__(
        self,
        table: TableView,
        balancer: Balancer,
        metrics: RouterMetrics,
        *,
        api_key: str | None = None,
        tenants: Tenants | None = None,
        upstream_keepalive_s: float = 2.0,
        gate: Gate | None = None,
        warmer: Warmer | None = None,
        cold_wait_s: float = 30.0,
        grow_at: int = 0,
        on_session_end: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.table = table
        self.balancer = balancer
        self.metrics = metrics
        self.api_key = api_key
        self.tenants = tenants
        self.upstream_keepalive_s = upstream_keepalive_s
        self.gate = gate
        self.warmer = warmer
        """Places a cold version (the control plane's ``Placer``, in one process or by HTTP)."""
        self.cold_wait_s = cold_wait_s
        self.grow_at = grow_at
        self.on_session_end = on_session_end
        """A copy's: hand the end to the control plane before answering (``Syncer.flush``)."""
        self.pipeline: Pipeline | None = None
        self.pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the connection pools; the hot paths answer from here on."""
        # Idle pooled connections are dropped below the 5 s after which uvicorn (the reference
        # engine, the agent, vLLM, SGLang) closes them itself.
        self.pooled = client_session(keepalive_timeout=self.upstream_keepalive_s)
        self._fresh = client_session(force_close=True)
        self.pipeline = Pipeline(
            self.table,
            self.balancer,
            self.metrics,
            self.pooled,
            fresh=self._fresh,
            api_key=self.api_key,
            tenants=self.tenants,
            gate=self.gate,
            warmer=self.warmer,
            cold_wait_s=self.cold_wait_s,
            grow_at=self.grow_at,
        )

    async def stop(self) -> None:
        self.pipeline = None
        for s in (self.pooled, self._fresh):
            if s is not None:
                await s.close()

    async def __call__(self, scope, receive, send) -> None:
        assert self.pipeline is not None, "DataPlane.start() first"
        await self.pipeline(scope, receive, send)

    def wants(self, scope) -> bool:
        """Whether ``scope`` is a hot path this data plane answers (and it is started)."""
        return (
            scope["type"] == "http"
            and scope["path"] in self.hot_paths
            and scope["method"] == "POST"
            and self.pipeline is not None
        )

    async def abort(self, rid: str, abort_all: bool, replicas: list[Replica] | None) -> int:
        """SGLang's abort of ``rid`` (or everything) on ``replicas`` (None: every one)."""
        if self.pipeline is None or self.pooled is None:
            return 0
        targets = self.balancer.replicas if replicas is None else replicas
        return await self.pipeline.live.abort(self.pooled, rid, abort_all, targets)

    async def finish_session(self, session: str) -> None:
        """Forget ``session``: its replica and its versions (on a copy: everywhere, once the
        control plane has taken the end and the other copies' long polls carry it on)."""
        self.balancer.sessions.forget(session)
        if self.on_session_end is not None:
            await self.on_session_end()
