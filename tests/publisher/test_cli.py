"""``lorafleet publish`` as a real subprocess against a real fleet."""

from __future__ import annotations

import json
import subprocess
import sys

from lorafleet.testing import greedy_completion, make_peft_adapter, merged_greedy_ids


def _publish(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorafleet", "publish", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_publish_cli_directory_and_native_checkpoint(launcher, make_fleet, tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file

    fleet = make_fleet(launcher, 2)
    target = [
        "--agents",
        ",".join(fleet.agent_urls),
        "--router",
        fleet.router.url,
        "--token",
        fleet.token,
    ]
    a = make_peft_adapter(tiny_model, tmp_path / "a", r=8, seed=31)
    r = _publish(str(a), "--name", "policy", *target)
    assert r.returncode == 0, r.stderr
    # Two agents on one host: one copy each (the relay is the default across hosts).
    assert "published policy v1 (atomic, remote_upload) as policy@v1" in r.stdout
    assert " 0 relayed)" in r.stdout
    assert "canary: none" in r.stderr  # skipped, and it says so

    # a native-only checkpoint file plus its config, published as v2
    ckpt = tmp_path / "native.pt"
    torch.save(load_file(a / "adapter_model.safetensors"), ckpt)
    r = _publish(
        str(ckpt), "--name", "policy", "--config", str(a / "adapter_config.json"), "--json", *target
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["version"] == 2 and out["retired_versions"] == [1]
    status, ids, body = greedy_completion(fleet.router.url, "policy")
    assert status == 200, body
    assert body["lorafleet"]["version"] == 2
    assert ids == merged_greedy_ids(tiny_model, a, "The quick brown fox", 8)

    # a stale version is refused with a clear message and a non-zero exit
    r = _publish(str(a), "--name", "policy", "--version", "1", *target)
    assert r.returncode == 1
    assert "not newer than the active version 2" in r.stderr

    # the canary computed on CPU from the base model and the directory, judged on each replica
    r = _publish(str(a), "--name", "policy", "--canary-model", str(tiny_model), *target)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("canary passed: mean |Δ log p|") == 2, r.stdout

    # a checkpoint file without its config is a usage error
    r = _publish(str(ckpt), "--name", "policy", *target)
    assert r.returncode == 2 and "--config" in r.stderr
