"""``LocalFleet``: engines, one agent per engine and a router as real processes on this host.

Reused by ``lorafleet up``, the demo, the tests and the benchmarks::

    with LocalFleet(FleetConfig.default(engines=2, data_dir=tmp)) as fleet:
        publisher = Publisher(agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token)
        ...

Processes are started by ``lorafleet.launch``: each binds to the configured host (127.0.0.1 by
default) on a socket the launcher bound, runs in its own session and is stopped with its whole
process group. Logs, agent stores and router state live in the data directory, which one fleet
holds at a time (a lock); ``fleet.json`` there tells ``lorafleet status`` where everything is.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import BaseFileLock

from lorafleet._dirlock import lock_directory
from lorafleet.agent.spec import AgentSpec
from lorafleet.dataplane.spec import DataPlaneSpec
from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.fleet.config import FleetConfig, ReplicaConfig
from lorafleet.fleetfile import (
    FleetInfo,
    ReplicaInfo,
    remove_fleet_file,
    write_fleet_file,
)
from lorafleet.launch import Launcher, ManagedProcess, Server
from lorafleet.router.spec import RouterSpec

__all__ = ["LocalFleet"]

_ENGINE_TIMEOUT = 120.0  # torch + transformers import on a busy 2-core box
_AGENT_TIMEOUT = 60.0
_ROUTER_TIMEOUT = 60.0


@dataclass
class _Replica:
    config: ReplicaConfig
    index: int
    agent_dir: Path
    engine: Server[ReferenceEngineSpec] | None = None
    """The engine lorafleet started; None for an engine someone else runs (``config.url``)."""
    agent: Server[AgentSpec] | None = None

    @property
    def engine_url(self) -> str:
        if self.engine is not None:
            return self.engine.url
        assert self.config.url is not None  # ReplicaConfig guarantees a URL for external engines
        return self.config.url.rstrip("/")


class LocalFleet:
    """A fleet of local processes; a context manager that stops everything it started.

    Args:
        config: what to run (default: ``FleetConfig.default()``: two reference engines).
        on_event: called with a short progress message (``lorafleet up`` prints them).
    """

    def __init__(
        self,
        config: FleetConfig | None = None,
        *,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config or FleetConfig.default()
        self.data_dir = Path(self.config.data_dir).absolute()
        self.token = self.config.control_token or secrets.token_urlsafe(24)
        self.api_key: str | None = (
            secrets.token_urlsafe(24) if self.config.api_key is None else self.config.api_key
        ) or None
        self._on_event = on_event or (lambda _msg: None)
        self._launcher = Launcher(self.data_dir / "logs")
        self._replicas: list[_Replica] = []
        self._router: Server[RouterSpec] | None = None
        self._dataplane: Server[DataPlaneSpec] | None = None
        self._lock: BaseFileLock | None = None
        self.model: Path | None = None
        self.started_at: float | None = None

    # -- public surface ------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.config.host

    @property
    def router_url(self) -> str:
        if self._router is None:
            raise RuntimeError("the fleet has no router yet: start() it first")
        return self._router.url

    @property
    def dataplane_url(self) -> str | None:
        """Where the data-plane copies serve (None: the fleet runs none)."""
        return self._dataplane.url if self._dataplane is not None else None

    @property
    def inference_url(self) -> str:
        """Where clients send generation: the data-plane copies, else the router."""
        return self.dataplane_url or self.router_url

    @property
    def agent_urls(self) -> list[str]:
        return [r.agent.url for r in self._replicas if r.agent is not None]

    @property
    def engine_urls(self) -> list[str]:
        return [r.engine_url for r in self._replicas]

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name

    @property
    def processes(self) -> list[ManagedProcess]:
        """Every process this fleet runs, data plane and router first."""
        servers: list[Server] = [s for s in (self._dataplane, self._router) if s is not None]
        for r in self._replicas:
            servers += [s for s in (r.agent, r.engine) if s is not None]
        return [s.proc for s in servers]

    def info(self) -> FleetInfo:
        """What ``fleet.json`` records."""
        replicas = [
            ReplicaInfo(
                engine=r.config.engine,
                engine_url=r.engine_url,
                agent_url=r.agent.url if r.agent else "",
                agent_pid=r.agent.pid if r.agent else None,
                engine_pid=r.engine.pid if r.engine else None,
            )
            for r in self._replicas
        ]
        router_pid = self._router.pid if self._router else None
        return FleetInfo.of(
            self, replicas, data_dir=str(self.data_dir), pid=os.getpid(), router_pid=router_pid
        )

    def write_fleet_file(self) -> Path:
        return write_fleet_file(self.info(), self.data_dir)

    def dead(self) -> list[str]:
        """Names of fleet processes that exited on their own (for supervision)."""
        return [p.name for p in self.processes if not p.alive()]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> LocalFleet:
        """Lock the data directory, then start engines, agents and the router, each tier in
        parallel and waited for ready.

        Raises:
            lorafleet._dirlock.DirectoryLocked: another fleet holds the data directory; nothing
                was started.
            RuntimeError, TimeoutError: a process died or never got ready (its log tail is in the
                message); everything already started is stopped first.
        """
        self._lock = lock_directory(self.data_dir, holder="lorafleet fleet (LocalFleet)")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.started_at = time.time()
        if any(r.managed_engine for r in self.config.replicas):
            if self.config.model is not None:
                self.model = Path(self.config.model).absolute()
            else:
                from lorafleet.tinymodel import ensure_tiny_model

                self.model = ensure_tiny_model()
        else:
            self.model = self.config.model
        self._replicas = [
            _Replica(config=rc, index=i, agent_dir=self.data_dir / "agents" / str(i))
            for i, rc in enumerate(self.config.replicas)
        ]
        self._start_engines()
        self._start_agents()
        self._router = self._launcher.spawn(
            RouterSpec(
                agents=tuple(self.agent_urls),
                token=self.token,
                api_key=self.api_key,
                state_dir=self.data_dir / "router",
                host=self.host,
                port=self.config.router.port,
                ready_timeout=_ROUTER_TIMEOUT,
            )
        )
        self._on_event(f"starting router on {self._router.url}")
        self._launcher.wait_ready(self._router)
        copies = self.config.router.copies
        if copies:
            self._dataplane = self._launcher.spawn(
                DataPlaneSpec(
                    control_url=self._router.url,
                    token=self.token,
                    api_key=self.api_key,
                    workers=copies,
                    host=self.host,
                    port=self.config.router.data_port,
                    ready_timeout=_ROUTER_TIMEOUT,
                )
            )
            self._on_event(f"starting {copies} data-plane copies on {self._dataplane.url}")
            self._launcher.wait_ready(self._dataplane)

    def _start_engines(self) -> None:
        for r in self._replicas:
            if not r.config.managed_engine:
                continue
            assert self.model is not None
            r.engine = self._launcher.spawn(
                ReferenceEngineSpec(
                    model=self.model,
                    served_model_name=self.served_model_name,
                    max_loras=r.config.max_loras,
                    max_lora_rank=r.config.max_lora_rank,
                    host=self.host,
                    port=r.config.engine_port,
                    name=f"engine-{r.index}",
                    ready_timeout=_ENGINE_TIMEOUT,
                )
            )
            self._on_event(f"starting reference engine {r.index} on {r.engine.url}")
        self._launcher.wait_ready(*[r.engine for r in self._replicas if r.engine])

    def _start_agents(self) -> None:
        for r in self._replicas:
            r.agent = self._launcher.spawn(
                AgentSpec(
                    engine=r.config.engine,
                    engine_url=r.engine_url,
                    data_dir=r.agent_dir,
                    token=self.token,
                    host=self.host,
                    port=r.config.agent_port,
                    settings=r.config.agent,
                    limits=r.config.limits,
                    name=f"agent-{r.index}",
                    ready_timeout=_AGENT_TIMEOUT,
                )
            )
            self._on_event(f"starting agent {r.index} ({r.config.engine}) on {r.agent.url}")
        self._launcher.wait_ready(*[r.agent for r in self._replicas if r.agent])

    def restart_engines(self, *, fresh_agents: bool = False) -> None:
        """Kill the engines lorafleet started and start them again from the base model.

        The engines come back on the same ports with no adapters. With ``fresh_agents`` the agents
        are also replaced by new ones with empty data directories (new nodes: nothing remembered,
        so only the trainer's next publish can bring the adapter back).
        """
        if fresh_agents:
            for r in self._replicas:
                if r.agent:
                    r.agent.stop()
                shutil.rmtree(r.agent_dir, ignore_errors=True)
        engines = [(r.index, r.engine) for r in self._replicas if r.engine is not None]
        for index, engine in engines:
            self._on_event(f"killing engine {index}")
            engine.proc.kill()  # a crash, not a polite shutdown
        for _, engine in engines:
            self._launcher.restart(engine, wait=False)
        self._launcher.wait_ready(*(engine for _, engine in engines))
        if fresh_agents:
            agents = [r.agent for r in self._replicas if r.agent]
            for agent in agents:
                self._launcher.restart(agent, wait=False)
            self._launcher.wait_ready(*agents)
        self.write_fleet_file_if_present()

    def write_fleet_file_if_present(self) -> None:
        """Refresh the pids in ``fleet.json`` if this fleet wrote one."""
        if (self.data_dir / "fleet.json").exists():
            self.write_fleet_file()

    def stop(self) -> None:
        """Stop the router, then the agents, then the engines; release the data directory.
        Idempotent."""
        self._launcher.stop_all()
        if self._lock is not None:
            remove_fleet_file(self.data_dir, owner_pid=os.getpid())
            self._lock.release()
            self._lock = None

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
