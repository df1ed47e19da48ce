"""``lorafleet up --ray``: the same fleet from the command line; ``lorafleet status`` shows it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from lorafleet.testing import wait_until


def test_up_ray_status_and_ctrl_c(ray_cluster, tmp_path):
    import ray

    from lorafleet.ray import attach

    data_dir = tmp_path / "fleet"
    fleet_json = data_dir / "fleet.json"
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "lorafleet", "up", "--ray", "--engines", "1"),
            *("--address", ray_cluster.address, "--namespace", "lf-test-up"),
            *("--data-dir", str(data_dir)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: fleet_json.exists() or up.poll() is not None, timeout=180, message="up")
        assert up.poll() is None, up.stdout.read()
        info = json.loads(fleet_json.read_text())
        assert info["router_url"] == attach("lf-test-up").router_url
        status = subprocess.run(
            [sys.executable, "-m", "lorafleet", "status", "--data-dir", str(data_dir), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["router_healthy"] is True
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out
    assert "fleet stopped" in out
    assert not fleet_json.exists()
    try:
        attach("lf-test-up")
    except LookupError:
        pass
    else:
        raise AssertionError("the fleet's actors outlived lorafleet up")
    assert ray.is_initialized()
