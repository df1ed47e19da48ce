"""``lorafleet inspect`` as a real subprocess: PEFT dir, native-only checkpoint, broken adapter."""

from __future__ import annotations

import json
import subprocess
import sys


def _inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorafleet", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_inspect_peft_dir(peft_dir):
    r = _inspect(str(peft_dir), "--name", "policy", "--version", "2")
    assert r.returncode == 0, r.stderr
    assert "policy  version 2" in r.stdout
    assert "adapter_model.safetensors" in r.stdout
    assert "valid:       yes" in r.stdout
    assert "preloadable: yes" in r.stdout


def test_inspect_json(peft_dir):
    r = _inspect(str(peft_dir), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["valid"] and out["rank"] == 8
    assert len(out["manifest"]["files"]) == 2


def test_inspect_native_only_checkpoint_with_config(peft_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    ckpt = tmp_path / "adapter_native.pt"
    torch.save(load_file(peft_dir / "adapter_model.safetensors"), ckpt)
    cfg = tmp_path / "lora.json"
    cfg.write_text((peft_dir / "adapter_config.json").read_text())
    r = _inspect(str(ckpt), "--config", str(cfg), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["valid"] and not out["preloadable"]

    # the same as a directory without adapter_config.json
    d = tmp_path / "native"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(
        (peft_dir / "adapter_model.safetensors").read_bytes()
    )
    r = _inspect(str(d), "--config", str(cfg))
    assert r.returncode == 0, r.stdout
    assert "preloadable: no" in r.stdout
    r = _inspect(str(d))
    assert r.returncode == 1
    assert "missing adapter_config.json" in r.stdout


def test_inspect_broken_adapter_exits_nonzero(adapter_copy):
    cfg = json.loads((adapter_copy / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (adapter_copy / "adapter_config.json").write_text(json.dumps(cfg))
    r = _inspect(str(adapter_copy))
    assert r.returncode == 1
    assert "valid:       NO" in r.stdout
    assert "DoRA" in r.stdout
