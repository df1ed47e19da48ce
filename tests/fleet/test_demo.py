"""``lorafleet demo --resume`` end to end: real fleet, real training, real restart."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from lorafleet.launch import lorafleet_argv


def test_demo_resume_restores_serving(tmp_path: Path, tiny_model: Path) -> None:
    summary_path = tmp_path / "summary.json"
    data_dir = tmp_path / "demo"
    out = subprocess.run(
        lorafleet_argv(
            "demo",
            "--resume",
            "--data-dir",
            str(data_dir),
            "--json-summary",
            str(summary_path),
        ),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    s = json.loads(summary_path.read_text())
    assert s["ok"] and not s["failures"]
    assert s["final_reward"] >= 0.9 > s["base_reward"]

    resume = s["resume"]
    # Nothing serves the adapter between the crash and the first publish...
    assert not resume["probe_after_restart"].startswith("served")
    # ...the checkpoint is native-only...
    assert "adapter_config.json" not in resume["checkpoint_files"]
    # ...and the first publish after the restart serves exactly what was served before the kill.
    assert resume["restored"] is True
    assert resume["output_after_restore"] == resume["output_before_kill"]
    restore = next(r for r in s["steps"] if r["phase"] == "restore")
    assert restore["served_version"] == restore["version"] == resume["restore_version"]
    assert restore["step"] == resume["killed_after_step"]

    # Every publish was served by the version it returned (promise 1, as seen by a client).
    assert all(r["served_version"] == r["version"] for r in s["steps"])
    assert "serving restored" in out.stdout
    assert not (data_dir / "fleet.json").exists()  # the fleet was stopped


def test_demo_async_keeps_every_rollout_inside_the_window(tmp_path: Path, tiny_model: Path) -> None:
    summary_path = tmp_path / "summary.json"
    out = subprocess.run(
        lorafleet_argv(
            "demo", "--async", "--steps", "4", "--data-dir", str(tmp_path / "demo"),
            "--json-summary", str(summary_path),
        ),
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    s = json.loads(summary_path.read_text())
    assert s["ok"] and s["failed"] == 0 and s["switched"] == 0
    assert s["rollouts"] > 0 and s["max_lag"] is not None and s["max_lag"] <= s["max_staleness"]
    assert [r["version"] for r in s["steps"]] == [2, 3, 4, 5]  # v1 went out before the loop
