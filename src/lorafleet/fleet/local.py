"""``LocalFleet``: engines, one agent per engine and a router as real processes on this host.

Reused by ``lorafleet up``, the demo, the tests and the benchmarks::

    with LocalFleet(FleetConfig.default(engines=2, data_dir=tmp)) as fleet:
        publisher = Publisher(agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token)
        ...

Every process binds to the configured host (127.0.0.1 by default), runs in its own session and is
stopped with its whole process group. Logs, agent stores and router state live in the data
directory; ``fleet.json`` there tells ``lorafleet status`` where everything is.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorafleet._procs import ManagedProcess, free_port, lorafleet_argv
from lorafleet.fleet.config import FleetConfig, ReplicaConfig
from lorafleet.fleet.state import (
    FleetInfo,
    ReplicaInfo,
    remove_fleet_file,
    write_fleet_file,
)

__all__ = ["LocalFleet"]

_ENGINE_TIMEOUT = 120.0  # torch + transformers import on a busy 2-core box
_AGENT_TIMEOUT = 60.0
_ROUTER_TIMEOUT = 60.0


@dataclass
class _Replica:
    config: ReplicaConfig
    index: int
    engine_url: str
    engine_port: int | None
    agent_port: int
    agent_url: str
    agent_dir: Path
    engine: ManagedProcess | None = None
    agent: ManagedProcess | None = None


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
        self._replicas: list[_Replica] = []
        self._router: ManagedProcess | None = None
        self._router_port: int | None = None
        self.model: Path | None = None
        self.started_at: float | None = None

    # -- public surface ------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.config.host

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self._router_port}"

    @property
    def agent_urls(self) -> list[str]:
        return [r.agent_url for r in self._replicas]

    @property
    def engine_urls(self) -> list[str]:
        return [r.engine_url for r in self._replicas]

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name

    @property
    def processes(self) -> list[ManagedProcess]:
        """Every process this fleet runs, router first."""
        procs = [self._router] if self._router else []
        for r in self._replicas:
            procs += [p for p in (r.agent, r.engine) if p is not None]
        return procs

    def info(self) -> FleetInfo:
        """What ``fleet.json`` records."""
        return FleetInfo(
            data_dir=str(self.data_dir),
            router_url=self.router_url,
            control_token=self.token,
            api_key=self.api_key,
            model=str(self.model),
            served_model_name=self.served_model_name,
            replicas=[
                ReplicaInfo(
                    engine=r.config.engine,
                    engine_url=r.engine_url,
                    agent_url=r.agent_url,
                    agent_pid=r.agent.pid if r.agent else None,
                    engine_pid=r.engine.pid if r.engine else None,
                )
                for r in self._replicas
            ],
            pid=os.getpid(),
            router_pid=self._router.pid if self._router else None,
            started_at=self.started_at,
        )

    def write_fleet_file(self) -> Path:
        return write_fleet_file(self.info(), self.data_dir)

    def dead(self) -> list[str]:
        """Names of fleet processes that exited on their own (for supervision)."""
        return [p.name for p in self.processes if not p.alive()]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> LocalFleet:
        """Start engines, then agents, then the router; each tier in parallel, waited for ready.

        Raises:
            RuntimeError, TimeoutError: a process died or never got ready (its log tail is in the
                message); everything already started is stopped first.
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.started_at = time.time()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if any(r.managed_engine for r in self.config.replicas):
            if self.config.model is not None:
                self.model = Path(self.config.model).absolute()
            else:
                from lorafleet.tinymodel import ensure_tiny_model

                self.model = ensure_tiny_model()
        else:
            self.model = self.config.model
        for i, rc in enumerate(self.config.replicas):
            engine_port = (rc.engine_port or free_port(self.host)) if rc.managed_engine else None
            engine_url = f"http://{self.host}:{engine_port}" if rc.managed_engine else rc.url
            assert engine_url is not None  # ReplicaConfig guarantees a URL for external engines
            agent_port = rc.agent_port or free_port(self.host)
            self._replicas.append(
                _Replica(
                    config=rc,
                    index=i,
                    engine_url=engine_url.rstrip("/"),
                    engine_port=engine_port,
                    agent_port=agent_port,
                    agent_url=f"http://{self.host}:{agent_port}",
                    agent_dir=self.data_dir / "agents" / str(i),
                )
            )
        self._start_engines(self._replicas)
        self._start_agents(self._replicas)
        self._router_port = self.config.router.port or free_port(self.host)
        argv = lorafleet_argv(
            "router",
            "--agents",
            ",".join(self.agent_urls),
            "--host",
            self.host,
            "--port",
            str(self._router_port),
            "--control-token",
            self.token,
            "--state-dir",
            str(self.data_dir / "router"),
        )
        if self.api_key:
            argv += ["--api-key", self.api_key]
        self._on_event(f"starting router on {self.router_url}")
        self._router = ManagedProcess(
            argv,
            ready_url=self.router_url + "/health",
            log_path=self.data_dir / "logs" / "router.log",
            name="router",
        )
        self._router.wait_ready(_ROUTER_TIMEOUT)

    def _start_engines(self, replicas: list[_Replica]) -> None:
        managed = [r for r in replicas if r.config.managed_engine]
        for r in managed:
            self._on_event(f"starting reference engine {r.index} on {r.engine_url}")
            r.engine = ManagedProcess(
                lorafleet_argv(
                    "engine",
                    "--model",
                    str(self.model),
                    "--served-model-name",
                    self.served_model_name,
                    "--host",
                    self.host,
                    "--port",
                    str(r.engine_port),
                    "--max-loras",
                    str(r.config.max_loras),
                    "--max-lora-rank",
                    str(r.config.max_lora_rank),
                ),
                ready_url=r.engine_url + "/health",
                log_path=self.data_dir / "logs" / f"engine-{r.index}.log",
                name=f"engine-{r.index}",
            )
        for r in managed:
            assert r.engine is not None
            r.engine.wait_ready(_ENGINE_TIMEOUT)

    def _start_agents(self, replicas: list[_Replica]) -> None:
        for r in replicas:
            self._on_event(f"starting agent {r.index} ({r.config.engine}) on {r.agent_url}")
            r.agent_dir.mkdir(parents=True, exist_ok=True)
            r.agent = ManagedProcess(
                lorafleet_argv(
                    "agent",
                    "--engine",
                    r.config.engine,
                    "--engine-url",
                    r.engine_url,
                    "--data-dir",
                    str(r.agent_dir),
                    "--host",
                    self.host,
                    "--port",
                    str(r.agent_port),
                    "--control-token",
                    self.token,
                ),
                ready_url=r.agent_url + "/health",
                log_path=self.data_dir / "logs" / f"agent-{r.index}.log",
                name=f"agent-{r.index}",
            )
        for r in replicas:
            assert r.agent is not None
            r.agent.wait_ready(_AGENT_TIMEOUT)

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
        for r in self._replicas:
            if r.engine:
                self._on_event(f"killing engine {r.index}")
                r.engine.kill()  # a crash, not a polite shutdown
                r.engine.stop()  # closes the log handle
        self._start_engines(self._replicas)
        if fresh_agents:
            self._start_agents(self._replicas)
        self.write_fleet_file_if_present()

    def write_fleet_file_if_present(self) -> None:
        """Refresh the pids in ``fleet.json`` if this fleet wrote one."""
        if (self.data_dir / "fleet.json").exists():
            self.write_fleet_file()

    def stop(self) -> None:
        """Stop the router, then the agents, then the engines. Idempotent."""
        if self._router:
            self._router.stop()
        for r in self._replicas:
            if r.agent:
                r.agent.stop()
        for r in self._replicas:
            if r.engine:
                r.engine.stop()
        remove_fleet_file(self.data_dir, owner_pid=os.getpid())

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
