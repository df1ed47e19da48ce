"""The front, in-process on a loopback port, over a 2-replica reference fleet sharing a dir."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from lorafleet.front.app import create_app
from lorafleet.front.service import FrontConfig
from lorafleet.testing import wait_until
from tests.fleets import Fleet

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@dataclass
class RunningFront:
    url: str
    fleet: Fleet
    shared: Path
    cfg: FrontConfig


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


class FrontServers:
    """Fronts under uvicorn, each in a thread of the test process, stopped together."""

    def __init__(self) -> None:
        self.servers: list[tuple[_Server, threading.Thread]] = []
        self.apps: dict[str, FastAPI] = {}
        """Each front's app by its base URL: a test reads ``app.state.front`` through it."""

    def start(self, cfg: FrontConfig) -> str:
        app = create_app(cfg)
        server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_until(lambda: server.started and server.servers, message="the front started")
        port = server.servers[0].sockets[0].getsockname()[1]
        self.servers.append((server, thread))
        url = f"http://127.0.0.1:{port}"
        self.apps[url] = app
        return url

    def stop(self) -> None:
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(timeout=10)


@pytest.fixture
def serve_front() -> Iterator[Callable[[FrontConfig], str]]:
    """``serve_front(cfg) -> base URL``: the front app under uvicorn in a thread of this test."""
    fronts = FrontServers()
    yield fronts.start
    fronts.stop()


@pytest.fixture
def front_fleet(launcher, make_fleet, tmp_path, serve_front) -> Callable[..., RunningFront]:
    """``front_fleet(router_api_key=None, **cfg)``: a 2-replica fleet whose agents allow
    ``tmp_path/shared``, and a front over it (``FrontConfig`` fields override the defaults)."""
    shared = tmp_path / "shared"
    shared.mkdir()

    def start(*, router_api_key: str | None = None, **overrides) -> RunningFront:
        fleet = make_fleet(launcher, 2, shared=shared, router=router_api_key is None)
        if router_api_key is not None:
            fleet.router = fleet.start_router(api_key=router_api_key, state_dir=tmp_path / "r")
        assert fleet.router is not None
        kwargs = {
            "agents": fleet.agent_urls,
            "router": fleet.router.url,
            "shared_dirs": [shared],
            "fleet_token": fleet.token,
            "api_key": router_api_key,
            **overrides,
        }
        cfg = FrontConfig(**kwargs)
        return RunningFront(serve_front(cfg), fleet, shared, cfg)

    return start
