"""One writer per directory: a second agent, router or fleet on the same directory is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from lorafleet._dirlock import DirectoryLocked, lock_directory
from lorafleet.agent.spec import AgentSpec
from lorafleet.fleet import FleetConfig, LocalFleet
from lorafleet.launch import lorafleet_argv
from lorafleet.router.spec import RouterSpec

NO_ENGINE = "http://127.0.0.1:9"


def _refused(server, directory: Path, holder) -> str:
    """Assert ``server`` exited non-zero naming ``directory`` and ``holder``; its output."""
    assert server.proc.wait(60) != 0
    out = server.proc.log_text()
    assert str(directory) in out and "already running" in out
    assert f"pid {holder.pid}" in out, out
    return out


def test_second_agent_on_a_data_dir_is_refused(launcher, tmp_path):
    spec = AgentSpec(engine_url=NO_ENGINE, data_dir=tmp_path / "store", token="t", ready_status=503)
    first = launcher.start(spec)
    second = launcher.spawn(spec)
    out = _refused(second, spec.data_dir, first)
    assert f"lorafleet agent on 127.0.0.1:{first.port}" in out
    assert httpx.get(first.url + "/v1/info").status_code == 200  # the first one carries on
    # The lock dies with its holder: after a crash the directory is usable at once.
    first.proc.kill()
    assert launcher.restart(first).alive()


def test_second_router_on_a_state_dir_is_refused(launcher, tmp_path):
    spec = RouterSpec(agents=(NO_ENGINE,), token="t", state_dir=tmp_path / "state")
    first = launcher.start(spec)
    second = launcher.spawn(spec)
    out = _refused(second, tmp_path / "state", first)
    assert f"lorafleet router on 127.0.0.1:{first.port}" in out
    assert httpx.get(first.url + "/health").status_code == 200


def test_up_on_a_data_dir_in_use_is_refused_and_starts_nothing(tmp_path):
    held = lock_directory(tmp_path, holder="another fleet")
    try:
        out = subprocess.run(
            lorafleet_argv("up", "--data-dir", str(tmp_path), "--engines", "1"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        held.release()
    assert out.returncode != 0
    assert str(tmp_path) in out.stderr and "already running" in out.stderr
    assert "another fleet" in out.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "fleet.json").exists()


def test_local_fleet_on_a_data_dir_in_use_is_refused(tmp_path):
    held = lock_directory(tmp_path, holder="lorafleet up")
    try:
        with pytest.raises(DirectoryLocked, match="lorafleet up") as err:
            LocalFleet(FleetConfig.default(engines=1, data_dir=tmp_path)).start()
        assert err.value.path == tmp_path.absolute()
    finally:
        held.release()
    assert not (tmp_path / "logs").exists()


def test_a_released_directory_can_be_taken_again(tmp_path):
    lock_directory(tmp_path, holder="one").release()
    lock_directory(tmp_path, holder="two").release()
    assert "two" in (tmp_path / ".lorafleet.holder").read_text()
