"""AdapterBundle from a directory, a PEFT model in memory and a state dict + config dict."""

from __future__ import annotations

import hashlib
import json

import pytest

from lorafleet.bundle import AdapterBundle, Manifest
from lorafleet.errors import ManifestInvalid
from lorafleet.protocol.manifest import PathError, check_file_path


def test_from_dir_hashes_allow_listed_files(peft_dir):
    b = AdapterBundle.from_dir(peft_dir, name="policy", version=3)
    assert [f.path for f in b.files] == ["adapter_config.json", "adapter_model.safetensors"]
    for f in b.files:  # README.md written by PEFT is not part of the bundle
        data = (peft_dir / f.path).read_bytes()
        assert f.size == len(data)
        assert f.sha256 == hashlib.sha256(data).hexdigest()
    assert b.version == 3 and b.name == "policy"
    assert b.config["r"] == 8
    assert b.base_model == b.config["base_model_name_or_path"]
    assert b.validate(max_rank=16).ok


def test_digest_is_canonical_and_version_sensitive(peft_dir):
    a = AdapterBundle.from_dir(peft_dir, name="policy", version=1)
    again = AdapterBundle.from_dir(peft_dir, name="policy", version=1)
    assert a.digest == again.digest
    assert a.with_version(2).digest != a.digest
    assert a.digest == hashlib.sha256(a.manifest.canonical_json()).hexdigest()


def test_with_version_does_not_rehash(peft_dir, monkeypatch):
    b = AdapterBundle.from_dir(peft_dir, name="policy", version=1)

    def boom(*a, **k):
        raise AssertionError("re-hashed")

    monkeypatch.setattr("lorafleet.bundle.bundle.sha256_file", boom)
    b2 = b.with_version(7, name="other")
    assert (b2.version, b2.name) == (7, "other")
    assert b2.files == b.files


def test_from_peft_model_in_memory_matches_save_pretrained(tiny_model, peft_dir, tmp_path):
    from lorafleet.testing import make_peft_model

    model = make_peft_model(tiny_model, r=8, seed=1)  # same seed as peft_dir
    b = AdapterBundle.from_peft_model(model, name="policy", version=1)
    weights = b.manifest.file("adapter_model.safetensors")
    on_disk = (peft_dir / "adapter_model.safetensors").read_bytes()
    assert weights.sha256 == hashlib.sha256(on_disk).hexdigest()
    assert isinstance(b.source("adapter_model.safetensors"), bytes)
    assert b.validate(max_rank=16).ok
    out = b.write_to(tmp_path / "written")
    assert (out / "adapter_model.safetensors").read_bytes() == on_disk
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8


def test_from_state_dict_native_checkpoint(peft_dir):
    """A native-only checkpoint: tensors with PEFT's in-memory key names, config on the side."""
    from safetensors.torch import load_file

    tensors = load_file(peft_dir / "adapter_model.safetensors")
    native = {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        ): v
        for k, v in tensors.items()
    }
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    b = AdapterBundle.from_state_dict(native, cfg, name="policy", version=5)
    assert b.validate(max_rank=16).ok
    assert b.tensor_shapes and all(".default." not in k for k in b.tensor_shapes)
    assert "adapter_config.json" in {f.path for f in b.files}


def test_native_dir_needs_config(peft_dir, tmp_path):
    d = tmp_path / "native"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(
        (peft_dir / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(ManifestInvalid, match="pass config"):
        AdapterBundle.from_dir(d, name="policy")
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    b = AdapterBundle.from_dir(d, name="policy", config=cfg)
    assert b.validate().ok
    assert isinstance(b.source("adapter_config.json"), bytes)


def test_from_any_dispatch(peft_dir):
    b = AdapterBundle.from_any(str(peft_dir), name="p", version=2)
    assert AdapterBundle.from_any(b, name="p", version=4).version == 4
    with pytest.raises(ManifestInvalid, match="needs config"):
        AdapterBundle.from_any({"x": 1}, name="p")
    with pytest.raises(ManifestInvalid):
        AdapterBundle.from_any(42, name="p")


@pytest.mark.parametrize("bad", ["../adapter_config.json", "/etc/passwd", "a/../b", "./x", "a\\b"])
def test_paths_that_escape(bad):
    with pytest.raises(PathError) as e:
        check_file_path(bad)
    assert e.value.kind == "escape"


@pytest.mark.parametrize("bad", ["model.py", "adapter_config.json.bak", "sub/adapter_config.json"])
def test_names_outside_allow_list(bad):
    with pytest.raises(PathError):
        check_file_path(bad)


def test_manifest_rejects_bad_fields():
    good = {"path": "adapter_config.json", "size": 1, "sha256": "a" * 64}
    Manifest(name="ok", version=1, config={}, files=[good])
    for bad in [
        {"name": "../x", "version": 1, "config": {}, "files": [good]},
        {"name": "ok", "version": 0, "config": {}, "files": [good]},
        {"name": "ok", "version": 1, "config": {}, "files": []},
        {"name": "ok", "version": 1, "config": {}, "files": [{**good, "sha256": "XYZ"}]},
        {"name": "ok", "version": 1, "config": {}, "files": [{**good, "size": -1}]},
        {"name": "ok", "version": 1, "config": {}, "files": [good, good]},
    ]:
        with pytest.raises(ValueError):
            Manifest.model_validate(bad)
