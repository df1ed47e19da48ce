"""The fork server with real processes: a forked server is managed as a new process would be.

Each test runs its own small fork server (``lorafleet.cli`` preloaded, ``agent`` served) in
place of the session's, so that what it checks does not depend on ``LORAFLEET_TEST_FORKSERVER``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorafleet.agent.spec import AgentSpec
from lorafleet.launch import Launcher, ManagedProcess, ProcessExited, bind_listener, forkserver
from lorafleet.testing import wait_until

NO_ENGINE = "http://127.0.0.1:9"  # an agent starts without its engine: /health answers 503


def _agent(data_dir: Path, **kw) -> AgentSpec:
    return AgentSpec(engine_url=NO_ENGINE, data_dir=data_dir, token="tok", ready_status=503, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[forkserver.ForkServer]:
    log = tmp_path_factory.mktemp("fork-server") / "server.log"
    with forkserver.ForkServer(["agent"], ["lorafleet.cli"], log_path=log) as server:
        server.wait_ready()
        yield server


@pytest.fixture
def only(server, monkeypatch) -> forkserver.ForkServer:
    """``server`` is the only fork server this process's launchers use."""
    monkeypatch.setattr(forkserver, "_servers", [server])
    return server


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def test_a_forked_agent_serves_logs_and_stops_as_a_new_process_would(only, tmp_path):
    with Launcher(tmp_path / "logs") as launcher:
        agent = launcher.start(_agent(tmp_path / "a"))
        assert isinstance(agent.proc.proc, forkserver.ForkedProcess)
        assert agent.pid != only.proc.pid
        _state, ppid, pgrp, session = _stat(agent.pid)[:4]
        # Its own session and group, as start_new_session gives a new process: killpg reaches
        # it and nothing else.
        assert int(ppid) == only.proc.pid and int(pgrp) == agent.pid == int(session)
        info = httpx.get(agent.url + "/v1/info").json()
        assert info["replica_id"] == f"127.0.0.1:{agent.port}"  # it serves on our socket

        # Frozen and thawed by pid, as the fault tests do.
        agent.proc.signal(signal.SIGSTOP)
        wait_until(lambda: _stat(agent.pid)[0] == "T", timeout=10)
        assert agent.alive()
        agent.proc.signal(signal.SIGCONT)
        assert httpx.get(agent.url + "/v1/info").status_code == 200

        # Restarted on the same port and log; the first run's exit status is SIGTERM's.
        first = agent.proc
        launcher.restart(agent)
        assert first.returncode == -signal.SIGTERM
        assert isinstance(agent.proc.proc, forkserver.ForkedProcess)
        assert httpx.get(agent.url + "/v1/info").json()["replica_id"].endswith(f":{agent.port}")

        agent.proc.kill()
        assert agent.proc.returncode == -signal.SIGKILL
        with pytest.raises(httpx.ConnectError):  # no copy of the socket is left anywhere
            httpx.get(agent.url + "/v1/info", timeout=5)


def test_a_command_that_fails_reports_its_status_and_its_output(only, tmp_path):
    with Launcher(tmp_path / "logs") as launcher:
        bad = _agent(tmp_path / "a", extra=("--no-such-option",))
        with pytest.raises(ProcessExited) as exc:
            launcher.start(bad)
        assert exc.value.returncode == 2  # click's usage error, as from a new interpreter
        assert "No such option '--no-such-option'" in exc.value.log_tail


def test_the_environment_and_directory_are_the_callers(only, tmp_path):
    spec = AgentSpec(engine_url=NO_ENGINE, data_dir=Path("relative-store"), token="from-env")
    with bind_listener() as sock:
        port = sock.getsockname()[1]
        proc = ManagedProcess(
            spec.argv(sock.fileno()),
            ready_url=f"http://127.0.0.1:{port}/health",
            env=spec.environ(),  # the control token travels here
            cwd=tmp_path,
            pass_fds=(sock.fileno(),),
        )
    with proc:
        assert isinstance(proc.proc, forkserver.ForkedProcess)
        proc.wait_ready(60, ready_status=503)
        assert (tmp_path / "relative-store").is_dir()  # relative to the cwd it was given
        register = f"http://127.0.0.1:{port}/v1/adapters/register"
        wrong = httpx.post(register, json={}, headers={"Authorization": "Bearer nope"})
        right = httpx.post(register, json={}, headers={"Authorization": "Bearer from-env"})
        assert wrong.status_code in (401, 403)
        assert right.status_code == 400  # past the token: the empty body is what is refused


def test_a_variable_read_at_import_time_is_refused_and_started_the_usual_way(only, tmp_path):
    # One read at run time passes (a Ray driver sets PYTHONBREAKPOINT in its own environment).
    ok = only.spawn(
        [sys.executable, "-m", "lorafleet", "agent", "--help"],
        env={**os.environ, "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"},
    )
    assert ok.wait(60) == 0
    with pytest.raises(forkserver.ForkRefused, match="PYTHONHASHSEED"):
        only.spawn(
            [sys.executable, "-m", "lorafleet", "agent", "--help"],
            env={**os.environ, "PYTHONHASHSEED": "12345"},
        )
    spec = _agent(tmp_path / "a", env={"PYTHONHASHSEED": "12345"})
    with Launcher(tmp_path / "logs") as launcher:
        agent = launcher.start(spec)
        assert isinstance(agent.proc.proc, subprocess.Popen)  # the usual way
        # The refused request's copy of the listening socket was closed: the port serves.
        assert httpx.get(agent.url + "/v1/info").status_code == 200


def test_poll_answers_while_another_thread_waits(only, tmp_path):
    with Launcher(tmp_path / "logs") as launcher:
        agent = launcher.start(_agent(tmp_path / "a"))
        proc = agent.proc.proc
        waiter = threading.Thread(target=proc.wait)
        waiter.start()
        wait_until(lambda: proc._lock.locked(), timeout=10)
        assert proc.poll() is None  # not stuck behind the waiting thread
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        os.killpg(agent.pid, signal.SIGKILL)
        waiter.join(30)
        assert not waiter.is_alive() and proc.returncode == -signal.SIGKILL


def test_a_caller_in_another_network_namespace_gets_a_process_started_there(only, tmp_path):
    from lorafleet.testing.netbed import NetBed, netns_available

    why = netns_available()
    if why:
        pytest.skip(why)
    argv = [sys.executable, "-m", "lorafleet", "agent", "--help"]
    with NetBed(1) as bed, Launcher(tmp_path / "logs") as launcher:
        host = bed.replicas[0]
        assert only.serves(argv)
        with bed.inside(host):
            # A fork of the server would run in the server's namespace, off the shaped link.
            assert not only.serves(argv)
        agent = bed.start(launcher, host, _agent(tmp_path / "a", host=host.addr))
        assert isinstance(agent.proc.proc, subprocess.Popen)
        with bed.inside(host):
            here = os.readlink("/proc/thread-self/ns/net")
        assert os.readlink(f"/proc/{agent.pid}/ns/net") == here


def test_a_server_that_is_gone_is_a_refusal_not_a_failure(tmp_path, monkeypatch):
    gone = forkserver.ForkServer(["agent"], ["lorafleet.cli"])
    gone.wait_ready()
    gone.proc.kill()
    gone.proc.wait()
    with pytest.raises(forkserver.ForkRefused):
        gone.spawn([sys.executable, "-m", "lorafleet", "agent", "--help"], env=dict(os.environ))
    monkeypatch.setattr(forkserver, "_servers", [gone])
    with Launcher(tmp_path / "logs") as launcher:
        agent = launcher.start(_agent(tmp_path / "a"))  # started the usual way
        assert isinstance(agent.proc.proc, subprocess.Popen)
    gone.stop()
