"""Poll each agent for who its replica is (``/v1/info``) and whether it is ready (``/health``).

Each replica is polled by its own loop, so a slow agent never delays the others. Outcomes go to
the balancer, which applies the hysteresis: an agent that answers "not ready" (it is reinstalling
adapters after an engine restart) leaves rotation at once, while a probe that times out or cannot
connect counts as one failure of ``unhealthy_after``. The probe timeout is generous on purpose: on
a busy machine an agent can take more than a second to answer, and that alone is no reason to
drop a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from lorafleet.dataplane.balancer import Balancer, Replica
from lorafleet.protocol.agent import AgentInfo

__all__ = ["HealthPoller"]

log = logging.getLogger("lorafleet.dataplane.health")


class _NotReady(Exception):
    """The agent answered, and said it is not ready."""


class HealthPoller:
    """Keeps ``balancer.replicas`` current; ``poll_once`` is also used at startup."""

    def __init__(
        self,
        balancer: Balancer,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 0.5,
        timeout_s: float = 5.0,
        token: str | None = None,
        on_change=None,
    ) -> None:
        self.balancer = balancer
        self.session = session
        self.interval_s = interval_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.on_change = on_change
        self._tasks: list[asyncio.Task] = []
        self._by_replica: dict[int, asyncio.Task] = {}

    async def _probe(self, r: Replica, url: str) -> None:
        """Raise if the agent at ``url`` cannot take traffic; refresh its identity when needed."""
        if r.engine_url is None or not r.healthy:
            # (Re)learn identity when it is unknown or the replica was out: it may have come
            # back with another engine URL.
            async with self.session.get(
                url + "/v1/info", headers=self.headers, timeout=self.timeout
            ) as resp:
                if resp.status != 200:
                    raise _NotReady(f"/v1/info answered {resp.status}")
                info = AgentInfo.model_validate_json(await resp.read())
            if r.agent_url == url:  # else: moved meanwhile; relearned at the new URL
                r.replica_id = info.replica_id
                r.engine_url = info.engine_url.rstrip("/")
                r.base_model = info.base_model
                r.kind = info.capabilities.kind
        async with self.session.get(
            url + "/health", headers=self.headers, timeout=self.timeout
        ) as resp:
            await resp.read()
            if resp.status != 200:
                raise _NotReady(f"agent /health answered {resp.status}")

    async def _poll(self, r: Replica) -> None:
        was, url = r.healthy, r.agent_url
        try:
            await self._probe(r, url)
            outcome = None
        except _NotReady as exc:
            outcome = (str(exc), True)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            outcome = (f"{type(exc).__name__}: {exc}", False)
        if r.agent_url != url:
            return  # moved (PUT /v1/control/replicas/...) while probed: about the old address
        if outcome is None:
            self.balancer.succeeded(r, probe=True)
        else:
            self.balancer.failed(r, outcome[0], definitive=outcome[1])
        if r.healthy != was:
            log.info(
                "replica %s (%s) healthy=%s %s", r.replica_id, r.agent_url, r.healthy, r.detail
            )
            self.balancer.reindex()
            if self.on_change is not None:
                self.on_change(self.balancer)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.balancer.replicas))
        self.balancer.reindex()
        if self.on_change is not None:
            self.on_change(self.balancer)

    async def _run(self, r: Replica) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._poll(r)
            except Exception:  # never let one bad poll stop health checking
                log.exception("health poll of %s failed", r.agent_url)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(r)) for r in self.balancer.replicas]
        self._by_replica = dict(zip(map(id, self.balancer.replicas), self._tasks, strict=True))

    def watch(self, r: Replica) -> None:
        """Poll a replica added after ``start`` (membership)."""
        task = asyncio.create_task(self._run(r))
        self._tasks.append(task)
        self._by_replica[id(r)] = task

    async def unwatch(self, r: Replica) -> None:
        """Stop polling a removed replica."""
        task = self._by_replica.pop(id(r), None)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._tasks.remove(task)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
