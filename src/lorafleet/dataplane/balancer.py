"""Replicas, their health, in-flight accounting and replica choice.

Choice is fewest outstanding requests, with sticky sessions (``sessions.py``). Health has
hysteresis: a replica leaves rotation after ``unhealthy_after`` consecutive failures (health
probes or real requests) and returns after ``healthy_after`` consecutive good probes, so one slow
probe on a busy machine does not drop it. An agent's own "not ready" answer and a refused
connection are definitive and take it out at once. When no replica of a version is in rotation,
``candidates`` falls back to trying all of them (a panic mode, as Envoy has) rather than
refusing without trying.

Everything here is synchronous on purpose: resolving a request and counting it in flight happen
with no ``await`` in between, so a drain that starts after an alias flip sees every request that
resolved to the old version.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from lorafleet.dataplane.sessions import Sessions

__all__ = ["Balancer", "Replica"]


@dataclass(eq=False)
class Replica:
    """One inference replica as learned from its agent."""

    agent_url: str
    replica_id: str | None = None
    engine_url: str | None = None
    base_model: str | None = None
    kind: str = "vllm"
    """The engine kind its agent reports: how requests must name an adapter there."""
    healthy: bool = False
    """In rotation. Changed only by ``Balancer.succeeded``/``failed`` (hysteresis)."""
    inflight: int = 0
    by_key: dict[tuple[str | None, int | None], int] = field(default_factory=dict)
    """In flight here per (name, version): what an eviction of a version here waits for."""
    detail: str | None = "not polled yet"
    failures: int = 0
    """Consecutive failed probes or requests."""
    successes: int = 0
    """Consecutive good probes while out of rotation."""
    probed: bool = False
    """Whether a probe has answered yet: the first good one puts a new replica in at once."""

    @property
    def routable(self) -> bool:
        return self.healthy and self.engine_url is not None


@dataclass
class _Drain:
    count: int = 0
    waiters: list[asyncio.Future] = field(default_factory=list)


class Balancer:
    """The replica set plus exact in-flight counts per replica and per (name, version)."""

    def __init__(
        self,
        agent_urls: list[str],
        *,
        unhealthy_after: int = 3,
        healthy_after: int = 2,
        sessions: Sessions | None = None,
    ) -> None:
        self.replicas: list[Replica] = [Replica(agent_url=u.rstrip("/")) for u in agent_urls]
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.by_id: dict[str, Replica] = {}
        self.sessions = sessions if sessions is not None else Sessions()
        self.inflight: dict[tuple[str | None, int | None], _Drain] = {}
        self.last_used: dict[tuple[str, int], float] = {}
        """(name, version) -> monotonic time a request for it last arrived (for eviction)."""
        self._rr = 0

    # --- membership ----------------------------------------------------------------------------

    def reindex(self) -> None:
        self.by_id = {r.replica_id: r for r in self.replicas if r.replica_id}

    def move(self, r: Replica, agent_url: str) -> None:
        """``r`` answers at ``agent_url`` from now on: out of rotation, its identity relearned
        at the next poll, no session stuck to it."""
        r.agent_url = agent_url
        r.engine_url = None
        r.healthy = r.probed = False
        r.failures = r.successes = 0
        r.detail = f"re-placed at {agent_url}, not polled yet"
        self.sessions.unstick(r)

    def add(self, agent_url: str) -> Replica:
        """A new replica (membership): out of rotation until its first good probe."""
        r = Replica(agent_url=agent_url.rstrip("/"))
        self.replicas.append(r)
        return r

    def remove(self, r: Replica) -> None:
        """Forget a replica (it was drained first): no session sticks to it."""
        self.replicas = [x for x in self.replicas if x is not r]
        self.sessions.unstick(r)
        self.reindex()

    def base_models(self) -> set[str]:
        return {r.base_model for r in self.replicas if r.base_model}

    # --- health --------------------------------------------------------------------------------

    def succeeded(self, r: Replica, *, probe: bool) -> None:
        """A good probe or a served request. Only probes bring a replica back into rotation."""
        r.failures = 0
        if r.healthy or not probe:
            return
        r.successes += 1
        if r.successes >= self.healthy_after or not r.probed:
            r.healthy, r.successes, r.detail = True, 0, None
        r.probed = True

    def failed(
        self, r: Replica, detail: str, *, definitive: bool = False, probe: bool = True
    ) -> None:
        """A failed probe or request; ``definitive`` (refused, or the agent says not ready) takes
        the replica out at once, anything else only after ``unhealthy_after`` in a row."""
        r.successes = 0
        r.failures += 1
        r.detail = detail
        r.probed = r.probed or probe
        if r.healthy and (definitive or r.failures >= self.unhealthy_after):
            r.healthy = False

    # --- choice --------------------------------------------------------------------------------

    def candidates(
        self, replica_ids: list[str] | None, base_model: str | None = None
    ) -> list[Replica]:
        """Routable replicas among ``replica_ids`` (None: any serving ``base_model``)."""
        return [r for r in self.known(replica_ids, base_model) if r.healthy]

    def known(self, replica_ids: list[str] | None, base_model: str | None = None) -> list[Replica]:
        """Every replica among ``replica_ids`` with a known engine URL, healthy or not: what to
        try when none is routable (a replica that looks unhealthy beats a 503 without trying)."""
        if replica_ids is None:
            return [
                r
                for r in self.replicas
                if r.engine_url is not None and (base_model is None or r.base_model == base_model)
            ]
        return [
            r
            for r in (self.by_id.get(rid) for rid in replica_ids)
            if r is not None and r.engine_url is not None
        ]

    def pick(
        self, cands: list[Replica], session: str | None = None, exclude: Replica | None = None
    ) -> Replica | None:
        """Fewest outstanding requests; a session sticks while its replica is a candidate."""
        if exclude is not None:
            cands = [r for r in cands if r is not exclude]
        if not cands:
            return None
        if session is not None:
            r = self.sessions.replica(session)
            if r is not None and r in cands:
                return r
        if len(cands) == 1:
            best = cands[0]
        else:
            # Rotate the starting point so ties spread instead of piling on the first replica.
            self._rr = (self._rr + 1) % len(cands)
            best = cands[self._rr]
            for r in cands:
                if r.inflight < best.inflight:
                    best = r
        if session is not None:
            self.sessions.stick(session, best)
        return best

    # --- accounting ----------------------------------------------------------------------------

    def begin(self, key: tuple[str | None, int | None]) -> None:
        if key[0] is not None and key[1] is not None:
            self.last_used[key] = time.monotonic()  # type: ignore[index]
        d = self.inflight.get(key)
        if d is None:
            d = self.inflight[key] = _Drain()
        d.count += 1

    def end(self, key: tuple[str | None, int | None]) -> None:
        d = self.inflight[key]
        d.count -= 1
        if d.count == 0:
            for w in d.waiters:
                if not w.done():
                    w.set_result(None)
            del self.inflight[key]

    def count(self, name: str | None, version: int | None) -> int:
        d = self.inflight.get((name, version))
        return d.count if d else 0

    @staticmethod
    def sent(r: Replica, key: tuple[str | None, int | None], n: int) -> None:
        """Count ``n`` (+1 or -1) request for ``key`` in flight on ``r``."""
        r.inflight += n
        left = r.by_key.get(key, 0) + n
        if left:
            r.by_key[key] = left
        else:
            r.by_key.pop(key, None)

    def count_on(self, agent_url: str, key: tuple[str, int] | None = None) -> int:
        """In flight on the replica at ``agent_url``: all of it, or for ``key`` only."""
        return sum(
            r.inflight if key is None else r.by_key.get(key, 0)
            for r in self.replicas
            if r.agent_url == agent_url
        )

    async def wait_drained(self, name: str, version: int, timeout_s: float) -> int:
        """Wait until (name, version) has nothing in flight or ``timeout_s`` passes; the count."""
        d = self.inflight.get((name, version))
        if d is None or d.count == 0:
            return 0
        fut = asyncio.get_running_loop().create_future()
        d.waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            pass
        finally:
            if fut in d.waiters:
                d.waiters.remove(fut)
        return self.count(name, version)
