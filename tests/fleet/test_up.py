"""``lorafleet up`` and ``lorafleet status`` as real subprocesses on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from lorafleet.fleetfile import FleetInfo, pid_alive, read_fleet_file
from lorafleet.launch import ManagedProcess, lorafleet_argv
from lorafleet.testing import make_peft_adapter, wait_until


def _wait_for_fleet(up: ManagedProcess, data_dir: Path, timeout: float = 150.0) -> FleetInfo:
    try:
        wait_until(
            lambda: (data_dir / "fleet.json").exists() or not up.alive(),
            timeout=timeout,
            message="fleet.json appeared",
        )
    except AssertionError:
        pytest.fail("fleet.json never appeared:\n" + up.log_tail())
    if not (data_dir / "fleet.json").exists():
        pytest.fail(f"lorafleet up exited with {up.proc.returncode}:\n{up.log_tail()}")
    return read_fleet_file(data_dir)


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(lorafleet_argv(*args), capture_output=True, text=True, timeout=60)


def test_up_status_and_sigint_shutdown(tmp_path: Path, tiny_model: Path) -> None:
    data_dir = tmp_path / "fleet"
    up = ManagedProcess(
        lorafleet_argv("up", "--data-dir", str(data_dir), "--engines", "2"),
        log_path=tmp_path / "up.log",
        name="up",
    )
    try:
        info = _wait_for_fleet(up, data_dir)
        assert stat.S_IMODE((data_dir / "fleet.json").stat().st_mode) == 0o600
        assert info.pid == up.pid
        assert len(info.replicas) == 2 and info.control_token and info.api_key
        pids = [info.router_pid] + [
            p for r in info.replicas for p in (r.agent_pid, r.engine_pid) if p
        ]
        assert len(pids) == 5 and all(pid_alive(p) for p in pids)
        urls = [info.router_url] + [u for r in info.replicas for u in (r.agent_url, r.engine_url)]

        # The banner carries the secrets and URLs.
        def banner_printed() -> str | None:  # fleet.json is written just before the banner
            tail = up.log_tail(80)
            return tail if info.api_key in tail else None

        banner = wait_until(banner_printed, message="the banner printed")
        assert info.control_token in banner and info.api_key in banner
        assert info.router_url in banner

        # A second fleet on the same data directory is refused, and starts nothing.
        again = _run("up", "--data-dir", str(data_dir))
        assert again.returncode != 0 and "already running" in again.stderr

        adapter = make_peft_adapter(tiny_model, tmp_path / "adapter", r=8, seed=3)
        published = _run("publish", str(adapter), "--name", "policy", "--fleet", str(data_dir))
        assert published.returncode == 0, published.stdout + published.stderr
        assert published.stdout.count("application applied") == 2, published.stdout
        for r in info.replicas:
            metrics = httpx.get(r.agent_url + "/metrics", timeout=10).text
            assert 'lorafleet_agent_application_checks_total{outcome="applied"} 1.0' in metrics

        status = _run("status", "--data-dir", str(data_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        for r in info.replicas:
            replica_id = r.agent_url.removeprefix("http://")
            row = next(line for line in status.stdout.splitlines() if replica_id in line)
            assert "healthy" in row and "unhealthy" not in row
        assert "active versions" in status.stdout
        # One adapter row per replica, each saying its engine was proven to apply it.
        rows = [line for line in status.stdout.splitlines() if "policy@v1" in line]
        rows = [line for line in rows if "active" in line or "staged" in line or "load" in line]
        assert len(rows) == 2 and all(" applied " in line for line in rows), status.stdout

        as_json = json.loads(_run("status", "--data-dir", str(data_dir), "--json").stdout)
        assert as_json["router_healthy"] is True
        assert [r["healthy"] for r in as_json["replicas"]] == [True, True]
        assert as_json["inflight_total"] == 0
        assert [a["application"] for r in as_json["replicas"] for a in r["adapters"]] == [
            "applied",
            "applied",
        ]

        # Ctrl-C (SIGINT to the `up` process only, as a terminal's would be with our sessions).
        os.kill(up.pid, signal.SIGINT)
        assert up.proc.wait(60) == 0, up.log_tail()
        assert "fleet stopped" in up.log_tail()
        assert not (data_dir / "fleet.json").exists()
        for pid in pids:
            assert not pid_alive(pid), f"pid {pid} survived"
        for url in urls:
            assert not _port_open(url), f"{url} still listening"
        # Logs and agent stores stay for inspection.
        assert (data_dir / "logs" / "router.log").exists()
    finally:
        up.stop()


def test_status_without_a_fleet(tmp_path: Path) -> None:
    out = _run("status", "--data-dir", str(tmp_path))
    assert out.returncode != 0
    assert "lorafleet up" in out.stderr


def test_up_rejects_a_bad_fleet_file(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.toml"
    bad.write_text("[[replica]]\nengine = 'vllm'\n")
    out = _run("up", str(bad), "--data-dir", str(tmp_path / "d"))
    assert out.returncode == 2 and "needs url" in out.stderr


def test_local_fleet_fronts_an_engine_it_did_not_start(
    launcher, tiny_model: Path, tmp_path
) -> None:
    """A ``[[replica]] url = ...`` engine: the fleet starts only the agent and leaves it running."""
    import httpx

    from lorafleet.fleet import FleetConfig, LocalFleet, ReplicaConfig
    from lorafleet.testing import start_reference_engine

    engine = start_reference_engine(launcher, tiny_model)
    config = FleetConfig(
        data_dir=tmp_path / "fleet",
        replicas=(ReplicaConfig(engine="reference", url=engine.url),),
    )
    with LocalFleet(config) as fleet:
        assert fleet.engine_urls == [engine.url]
        assert fleet.info().replicas[0].engine_pid is None
        r = httpx.post(
            fleet.router_url + "/v1/completions",
            headers={"Authorization": f"Bearer {fleet.api_key}"},
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        replica_id = httpx.get(fleet.agent_urls[0] + "/v1/info").json()["replica_id"]
        assert r.json()["lorafleet"]["replica"] == replica_id
    assert engine.alive()  # not ours to stop
