"""Every validation error, each on a real adapter broken in one way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from lorafleet.bundle import validate_adapter_dir


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _one_problem(d: Path, **kw) -> str:
    report = validate_adapter_dir(d, **kw)
    assert not report.ok
    assert not report.preloadable
    assert len(report.problems) == 1, report.problems
    return report.problems[0]


def test_valid_peft_dir_is_ok_and_preloadable(peft_dir):
    report = validate_adapter_dir(peft_dir, max_rank=16)
    assert report.ok, report.problems
    assert report.preloadable
    assert report.rank == 8
    assert report.tensors == 16  # 2 layers x 4 modules x (A, B)


def test_missing_config(adapter_copy):
    (adapter_copy / "adapter_config.json").unlink()
    assert "missing adapter_config.json" in _one_problem(adapter_copy)


def test_missing_config_with_config_dict_is_valid_but_not_preloadable(adapter_copy, peft_dir):
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    (adapter_copy / "adapter_config.json").unlink()
    report = validate_adapter_dir(adapter_copy, config=cfg)
    assert report.ok, report.problems
    # seed 004: never preload a directory the engine cannot read on its own
    assert not report.preloadable


def test_malformed_config(adapter_copy):
    (adapter_copy / "adapter_config.json").write_text('{"r": 8, ')
    assert "not valid JSON" in _one_problem(adapter_copy)


def test_config_not_an_object(adapter_copy):
    (adapter_copy / "adapter_config.json").write_text("[1, 2]")
    assert "JSON object" in _one_problem(adapter_copy)


def test_peft_type_other_than_lora(adapter_copy):
    _edit_config(adapter_copy, peft_type="PREFIX_TUNING")
    assert "peft_type is 'PREFIX_TUNING'" in _one_problem(adapter_copy)


@pytest.mark.parametrize("key", ["r", "lora_alpha", "target_modules"])
def test_missing_required_key(adapter_copy, key):
    _edit_config(adapter_copy, **{key: ...})
    problems = validate_adapter_dir(adapter_copy).problems
    assert f"missing required keys: {key}" in problems[0]


def test_tensor_names_not_in_target_modules(adapter_copy):
    _edit_config(adapter_copy, target_modules=["q_proj", "k_proj", "v_proj"])
    report = validate_adapter_dir(adapter_copy)
    assert not report.ok
    assert all("o_proj" in p and "not in target_modules" in p for p in report.problems)
    assert len(report.problems) == 4  # o_proj A and B in 2 layers


def test_non_lora_tensor(adapter_copy):
    path = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.lm_head.weight"] = next(iter(tensors.values())).clone()
    save_file(tensors, path)
    assert "is not a LoRA weight" in _one_problem(adapter_copy)


def test_shapes_disagree_with_r(adapter_copy):
    _edit_config(adapter_copy, r=4)
    report = validate_adapter_dir(adapter_copy)
    assert not report.ok
    assert len(report.problems) == 8
    assert all("have rank 8, but r=4" in p for p in report.problems)


def test_lora_a_and_b_disagree(adapter_copy):
    path = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = tensors[key][:, :4].clone()
    save_file(tensors, path)
    assert "disagree on the rank" in _one_problem(adapter_copy)


def test_both_bin_and_safetensors(adapter_copy):
    import torch

    tensors = load_file(adapter_copy / "adapter_model.safetensors")
    torch.save(tensors, adapter_copy / "adapter_model.bin")
    assert "both adapter_model.safetensors and adapter_model.bin" in _one_problem(adapter_copy)


def test_no_weights(adapter_copy):
    (adapter_copy / "adapter_model.safetensors").unlink()
    assert "no adapter weights" in _one_problem(adapter_copy)


def test_bin_only_is_valid(adapter_copy):
    import torch

    tensors = load_file(adapter_copy / "adapter_model.safetensors")
    (adapter_copy / "adapter_model.safetensors").unlink()
    torch.save(tensors, adapter_copy / "adapter_model.bin")
    report = validate_adapter_dir(adapter_copy)
    assert report.ok, report.problems
    assert report.tensors == 16


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_features_vllm_refuses(adapter_copy, change, needle):
    _edit_config(adapter_copy, **change)
    assert needle in _one_problem(adapter_copy)


def test_rank_above_engine_limit(peft_dir):
    problem = _one_problem(peft_dir, max_rank=4)
    assert problem == "LoRA rank 8 is greater than max_lora_rank 4"


def test_corrupt_safetensors_header(adapter_copy):
    (adapter_copy / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert "cannot read adapter weights" in validate_adapter_dir(adapter_copy).problems[0]


def test_every_problem_reported_at_once(adapter_copy):
    _edit_config(adapter_copy, use_dora=True, bias="all", peft_type="IA3")
    assert len(validate_adapter_dir(adapter_copy).problems) == 3
