"""A test fleet of real processes: reference engines, one agent each, and optionally a router.

One factory for every test that needs a fleet (``make_fleet`` in tests/conftest.py). The
processes live as long as the ``Launcher`` they are started on: a test's own (``launcher``) for
a fresh fleet per test, or a module-scoped one for a fleet shared by a module.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lorafleet.agent.spec import AgentSpec
from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.launch import Launcher, Server
from lorafleet.router.spec import RouterSpec
from lorafleet.testing import (
    agent_spec,
    reference_engine_spec,
    start_router,
    wait_until,
)


@dataclass
class Replica:
    replica_id: str
    engine: Server[ReferenceEngineSpec]
    agent: Server[AgentSpec]


@dataclass
class Fleet:
    launcher: Launcher = field(repr=False)
    replicas: list[Replica]
    token: str
    """The control token of every agent and of the router."""
    health_interval: float
    router: Server[RouterSpec] | None = None

    @property
    def engines(self) -> list[Server[ReferenceEngineSpec]]:
        return [r.engine for r in self.replicas]

    @property
    def agents(self) -> list[Server[AgentSpec]]:
        return [r.agent for r in self.replicas]

    @property
    def agent_urls(self) -> list[str]:
        return [a.url for a in self.agents]

    def start_router(self, launcher: Launcher | None = None, **kwargs: Any) -> Server[RouterSpec]:
        """A router over this fleet's agents with its token, on ``launcher`` (default: the
        fleet's). ``kwargs`` go to ``lorafleet.testing.start_router``."""
        kwargs.setdefault("health_interval", self.health_interval)
        return start_router(launcher or self.launcher, self.agents, token=self.token, **kwargs)

    def staging_bytes(self) -> list[int]:
        out = []
        for a in self.agents:
            total = 0
            for dirpath, _, files in os.walk(a.spec.data_dir / "staging"):
                total += sum((Path(dirpath) / f).stat().st_size for f in files)
            out.append(total)
        return out

    def in_engine(self, i: int) -> list[str]:
        """The engine names agent ``i`` holds in its engine (loaded or active)."""
        return [a["engine_name"] for a in self.adapters(i) if a["state"] in ("loaded", "active")]

    @contextlib.contextmanager
    def watch_slots(self, slots: int) -> Iterator[list[tuple[int, list[str]]]]:
        """For the block, watch every engine in a thread (every 50 ms) and yield the list of
        times one held more than ``slots`` adapters: (replica index, what it held)."""
        over: list[tuple[int, list[str]]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                for i in range(len(self.agents)):
                    if len(held := self.in_engine(i)) > slots:
                        over.append((i, held))
                stop.wait(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield over
        finally:
            stop.set()
            watcher.join(10)

    def adapters(self, i: int, name: str | None = None) -> list[dict]:
        """Agent ``i``'s adapters (only ``name``'s versions, if given: on a shared fleet)."""
        r = httpx.get(f"{self.agents[i].url}/v1/adapters", headers=self._auth, timeout=10)
        r.raise_for_status()
        return [a for a in r.json()["adapters"] if name is None or a["name"] == name]

    def aliases(self) -> dict[str, dict]:
        """The router's alias table (without its flip log), by name."""
        assert self.router is not None
        r = httpx.get(
            f"{self.router.url}/v1/control/aliases",
            params={"log": "false"},
            headers=self._auth,
            timeout=10,
        )
        r.raise_for_status()
        return r.json()["aliases"]

    def engine_models(self, i: int) -> set[str]:
        r = httpx.get(f"{self.engines[i].url}/v1/models", timeout=10)
        return {m["id"] for m in r.json()["data"]}

    def forget(self, name: str) -> None:
        """Remove ``name`` from the fleet: its alias at the router, then every version of it on
        every agent (and so its engine). What a test on a fleet shared by its module does when
        it ends, so that the next test finds the engines' adapter slots free."""
        if self.router is not None and self.router.proc.alive():
            url = f"{self.router.url}/v1/control/aliases/{name}"
            r = httpx.delete(url, headers=self._auth, timeout=10)
            assert r.status_code in (204, 404), r.text
        for i, agent in enumerate(self.agents):
            for a in self.adapters(i, name):
                body = {"name": name, "version": a["version"]}
                r = httpx.post(
                    f"{agent.url}/v1/adapters/unload", json=body, headers=self._auth, timeout=30
                )
                assert r.status_code == 200, r.text

        def gone() -> bool:
            return not any(
                self.adapters(i, name)
                or any(m == name or m.startswith(f"{name}@v") for m in self.engine_models(i))
                for i in range(len(self.agents))
            )

        wait_until(gone, message=f"{name} gone from every agent and engine")

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def restart_agent(self, i: int) -> Server[AgentSpec]:
        """Stop agent ``i`` and start it again: same data directory, same port."""
        return self.launcher.restart(self.agents[i])


class FleetFactory:
    """``make_fleet(launcher, n=2, ...)``: start a fleet on ``launcher``; see ``__call__``."""

    def __init__(self, model: Path, tmp_path_factory) -> None:
        self.model = model
        self.tmp_path_factory = tmp_path_factory

    def __call__(
        self,
        launcher: Launcher,
        n: int = 2,
        *,
        ranks: list[int] | None = None,
        max_loras: int = 8,
        replica_ids: bool = False,
        shared: Path | None = None,
        router: bool = True,
        health_interval: float = 0.2,
    ) -> Fleet:
        """Start ``n`` replicas (and a router over them unless ``router=False``).

        Args:
            ranks: each replica's max LoRA rank, on its engine and its agent (default 64 all).
            max_loras: every engine's adapter slots.
            replica_ids: name replicas ``r<i>-<engine port>`` instead of the agent's host:port.
            shared: a directory every agent may register adapters from (shared filesystem).
            health_interval: the router's health poll, for ``router=True`` and ``start_router``.
        """
        root = self.tmp_path_factory.mktemp("fleet")
        token = secrets.token_urlsafe(12)
        ranks = ranks or [64] * n
        assert len(ranks) == n, (ranks, n)
        # The engines and agents start at once and the fleet waits for them together: each
        # engine's torch import takes seconds of CPU, a socket server's URL is known at spawn,
        # and an agent is ready only once its engine answers.
        engines = [
            launcher.spawn(reference_engine_spec(self.model, max_loras=max_loras, max_lora_rank=r))
            for r in ranks
        ]
        replicas = []
        for i, (engine, rank) in enumerate(zip(engines, ranks, strict=True)):
            rid = f"r{i}-{engine.port}" if replica_ids else None
            agent = launcher.spawn(
                agent_spec(
                    engine,
                    root / f"agent{i}",
                    token=token,
                    replica_id=rid,
                    max_lora_rank=rank,
                    shared_fs_allow=(shared,) if shared else (),
                )
            )
            replicas.append(Replica(rid or f"{agent.host}:{agent.port}", engine, agent))
        fleet = Fleet(launcher, replicas, token, health_interval)
        launcher.wait_ready(*engines, *fleet.agents)
        if router:
            fleet.router = fleet.start_router(state_dir=root / "router")
        return fleet
