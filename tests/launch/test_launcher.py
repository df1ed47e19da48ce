"""The launcher with real processes on loopback: socket hand-off, restarts, port retries."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafleet.agent.spec import AgentSpec
from lorafleet.launch import Launcher, PortServerSpec, ProcessExited, bind_listener
from lorafleet.launch import listen as listen_mod
from lorafleet.router.spec import RouterSpec

# An agent needs no engine to start: it answers /health with 503 until it reaches one.
NO_ENGINE = "http://127.0.0.1:9"


def _agent(data_dir: Path, **kw) -> AgentSpec:
    return AgentSpec(engine_url=NO_ENGINE, data_dir=data_dir, token="tok", ready_status=503, **kw)


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_server_serves_on_the_socket_the_launcher_bound(launcher, tmp_path):
    agent = launcher.start(_agent(tmp_path / "a"))
    assert "--fd" in agent.proc.argv and "--port" not in agent.proc.argv
    assert agent.port != 0 and agent.url == f"http://127.0.0.1:{agent.port}"
    # The agent learned its address from the socket: its default replica id is the real one.
    assert httpx.get(agent.url + "/v1/info").json()["replica_id"] == f"127.0.0.1:{agent.port}"
    # The launcher kept no copy of the socket: once the child is gone, connections are refused
    # (a copy in the parent would accept them into its backlog and leave clients hanging).
    agent.proc.kill()
    assert _refused(agent.port)


def test_restart_comes_back_on_the_same_port_and_log(launcher, tmp_path):
    agent = launcher.start(_agent(tmp_path / "a"))
    port, pid = agent.port, agent.pid
    assert launcher.restart(agent) is agent
    assert agent.port == port and agent.pid != pid and agent.alive()
    assert httpx.get(agent.url + "/v1/info").json()["replica_id"] == f"127.0.0.1:{port}"
    assert agent.log_path.name == "agent.log"
    log = agent.log_path.read_text()  # appended: the first run's lines are kept
    assert f"Started server process [{pid}]" in log
    assert f"Started server process [{agent.pid}]" in log


def test_log_files_are_named_after_the_spec(launcher, tmp_path):
    one = launcher.start(_agent(tmp_path / "a"))
    two = launcher.start(_agent(tmp_path / "b"))
    three = launcher.start(_agent(tmp_path / "c", name="agent-x"))
    assert [s.log_path.name for s in (one, two, three)] == [
        "agent.log",
        "agent-2.log",
        "agent-x.log",
    ]


def test_stop_all_stops_newest_first(tmp_path):
    with Launcher(tmp_path / "logs") as launcher:
        agent = launcher.start(_agent(tmp_path / "a"))
        router = launcher.start(RouterSpec(agents=(agent.url,), token="tok"))
        assert launcher.servers == [agent, router]
    assert not agent.alive() and not router.alive() and launcher.servers == []


def test_secrets_go_in_the_environment_not_argv(tmp_path):
    spec = RouterSpec(agents=("http://a",), token="control-secret", api_key="key-secret")
    argv = " ".join(spec.argv(3))
    assert "control-secret" not in argv and "key-secret" not in argv
    assert spec.environ()["LORAFLEET_CONTROL_TOKEN"] == "control-secret"
    assert spec.environ()["LORAFLEET_API_KEY"] == "key-secret"
    # None means none, even when the launcher's own environment has one.
    assert RouterSpec(agents=("http://a",)).environ()["LORAFLEET_CONTROL_TOKEN"] == ""


@dataclass(frozen=True, kw_only=True)
class HttpServerSpec(PortServerSpec):
    """``python -m http.server``: binds its own port, like vLLM."""

    directory: Path
    name: str = "http"
    ready_path: str = "/"

    def argv(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "http.server",
            "--bind", self.host, "--directory", str(self.directory), str(port),
        ]  # fmt: skip


def test_port_server_moves_when_its_reserved_port_is_taken(launcher, tmp_path, monkeypatch):
    taken = bind_listener()  # another process got the port between reservation and bind
    taken_port = taken.getsockname()[1]
    real = listen_mod.reserve_port
    handed: list[int] = []

    def reserve(host: str) -> int:
        handed.append(taken_port if not handed else real(host))
        return handed[-1]

    monkeypatch.setattr(listen_mod, "reserve_port", reserve)
    try:
        server = launcher.start(HttpServerSpec(directory=tmp_path))
    finally:
        taken.close()
    assert handed[0] == taken_port and server.port == handed[-1] != taken_port
    assert httpx.get(server.url + "/").status_code == 200
    assert "address already in use" in server.log_path.read_text().lower()


def test_port_server_on_a_fixed_port_is_not_moved(launcher, tmp_path):
    taken = bind_listener()
    try:
        with pytest.raises(ProcessExited, match=r"(?i)address already in use"):
            launcher.start(HttpServerSpec(directory=tmp_path, port=taken.getsockname()[1]))
    finally:
        taken.close()
