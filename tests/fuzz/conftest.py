"""What the fuzz tests run against, started once for the package.

Two reference engines in this process, on one torch import: an open one served by uvicorn on a
loopback socket (the fleet's engine) and one with an API key, driven in process. A real agent
process in front of the open engine, and a real router process over that agent with a control
token and an API key.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from fastapi import FastAPI

from lorafleet.agent.spec import AgentSpec
from lorafleet.launch import Launcher, Server
from lorafleet.launch.listen import bind_listener
from lorafleet.router.spec import RouterSpec
from lorafleet.testing import start_agent, start_router, wait_until

TOKEN = "fuzz-control-token"
API_KEY = "fuzz-api-key"
ENGINE_KEY = "fuzz-engine-key"
# Short generations: a fuzzed max_tokens (or none) never costs more than this many tokens.
MAX_MODEL_LEN = 64


@dataclass
class Targets:
    engine_url: str
    """The open engine, on loopback."""
    keyed_engine: FastAPI
    """The engine with ``ENGINE_KEY``, in process."""
    agent: Server[AgentSpec]
    router: Server[RouterSpec]


class _ThreadServer:
    """uvicorn serving ``app`` on a loopback socket from a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = bind_listener()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> _ThreadServer:
        self.thread.start()
        wait_until(
            lambda: self.server.started or not self.thread.is_alive(), message="engine started"
        )
        assert self.server.started, "engine never started"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="package")
def targets(tiny_model, tmp_path_factory) -> Iterator[Targets]:
    from lorafleet.engine._runtime import Runtime
    from lorafleet.engine.app import create_app

    # One runtime per app: each is driven from its own event loop.
    runtimes = [
        Runtime(tiny_model, served_model_name="tiny", max_model_len=MAX_MODEL_LEN) for _ in range(2)
    ]
    try:
        with (
            _ThreadServer(create_app(runtimes[0])) as engine,
            Launcher(tmp_path_factory.mktemp("fuzz-logs")) as launcher,
        ):
            data = tmp_path_factory.mktemp("fuzz-agent")
            agent = start_agent(launcher, engine.url, data, token=TOKEN, replica_id="r0")
            router = start_router(
                launcher, [agent], token=TOKEN, api_key=API_KEY, health_interval=0.2
            )
            keyed = create_app(runtimes[1], api_key=ENGINE_KEY)
            yield Targets(engine.url, keyed, agent, router)
    finally:
        for runtime in runtimes:
            runtime.close()
