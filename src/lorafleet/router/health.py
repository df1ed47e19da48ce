"""Poll each agent for who its replica is (``/v1/info``) and whether it is ready (``/health``).

A replica is in rotation only while its agent answers ``/health`` with 200. The agent reports
not-ready until it has reinstalled its desired adapters, so "healthy" implies "holds them".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from lorafleet.protocol.agent import AgentInfo
from lorafleet.router.balancer import Balancer, Replica

__all__ = ["HealthPoller"]

log = logging.getLogger("lorafleet.router.health")


class HealthPoller:
    """Keeps ``balancer.replicas`` current; ``poll_once`` is also used at startup."""

    def __init__(
        self,
        balancer: Balancer,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 0.5,
        token: str | None = None,
        on_change=None,
    ) -> None:
        self.balancer = balancer
        self.session = session
        self.interval_s = interval_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * interval_s))
        self.on_change = on_change
        self._task: asyncio.Task | None = None

    async def _poll(self, r: Replica) -> None:
        try:
            if r.engine_url is None or not r.healthy or r.suspect:
                # (Re)learn identity when it is unknown, the replica was down or its engine
                # refused connections: it may have come back with another engine URL.
                async with self.session.get(
                    r.agent_url + "/v1/info", headers=self.headers, timeout=self.timeout
                ) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"/v1/info answered {resp.status}")
                    info = AgentInfo.model_validate_json(await resp.read())
                r.replica_id = info.replica_id
                r.engine_url = info.engine_url.rstrip("/")
                r.base_model = info.base_model
            async with self.session.get(
                r.agent_url + "/health", headers=self.headers, timeout=self.timeout
            ) as resp:
                await resp.read()
                healthy = resp.status == 200
                detail = None if healthy else f"agent /health answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
            healthy, detail = False, f"{type(exc).__name__}: {exc}"
        if healthy != r.healthy:
            log.info("replica %s (%s) healthy=%s %s", r.replica_id, r.agent_url, healthy, detail)
        r.healthy, r.detail = healthy, detail
        if healthy:
            r.suspect = False

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.balancer.replicas))
        self.balancer.reindex()
        if self.on_change is not None:
            self.on_change(self.balancer)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # never let one bad poll stop health checking
                log.exception("health poll failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
