"""Validation with one engine kind's rulebook, on real PEFT adapters changed in one way.

The cases are the ones where the trainer-side validator and the reference engine used to
disagree (``init_lora_weights="eva"``, ``modules_to_save``), and the ones where SGLang 0.5.23
differs from vLLM 0.32. Sources are cited per rule in ``lorafleet.rules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet.bundle import AdapterBundle, validate_adapter_dir

KINDS = [None, "vllm", "sglang", "reference"]


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("engine", KINDS)
def test_eva_init_is_valid_for_every_engine_kind(adapter_copy, engine):
    """EVA only initialises the adapter (peft 0.21: lora_B zeroed, lora_A from activations), so
    the saved adapter is a plain LoRA: vLLM 0.32 ``PEFTHelper._init_is_supported`` lists "eva";
    SGLang 0.5.23 ``LoRAConfig`` never reads init_lora_weights. It used to be refused here."""
    _edit_config(adapter_copy, init_lora_weights="eva")
    report = validate_adapter_dir(adapter_copy, engine=engine)
    assert report.ok, report.problems
    assert report.preloadable


@pytest.mark.parametrize("engine", KINDS)
def test_pissa_init_is_refused_by_every_engine_kind(adapter_copy, engine):
    """PiSSA changes the base weights when PEFT loads the adapter (vLLM 0.32's refusal text)."""
    _edit_config(adapter_copy, init_lora_weights="pissa")
    (problem,) = validate_adapter_dir(adapter_copy, engine=engine).problems
    assert problem.startswith("init_lora_weights='pissa' is not supported by ")


@pytest.mark.parametrize(
    ("engine", "ok"), [(None, True), ("vllm", True), ("reference", True), ("sglang", False)]
)
def test_modules_to_save_score_head_in_the_config(adapter_copy, engine, ok):
    """vLLM 0.32 ``PEFTHelper._validate_features`` accepts modules_to_save=["score"] (the tensors
    hold no head here); SGLang 0.5.23 loads LoRA weights only, so lorafleet refuses any
    modules_to_save for it. By default a topic is refused only when every engine kind refuses it.
    """
    _edit_config(adapter_copy, modules_to_save=["score"])
    report = validate_adapter_dir(adapter_copy, engine=engine)
    assert report.ok is ok, report.problems
    if not ok:
        assert report.problems == [
            "modules_to_save=['score'] is not supported by SGLang: an engine serves LoRA "
            "weights, not full copies of modules"
        ]


@pytest.mark.parametrize("engine", KINDS)
def test_modules_to_save_lm_head_is_refused_by_every_engine_kind(adapter_copy, engine):
    """vLLM 0.32 allows only a classifier head; SGLang 0.5.23 would drop the module."""
    _edit_config(adapter_copy, modules_to_save=["lm_head"])
    (problem,) = validate_adapter_dir(adapter_copy, engine=engine).problems
    assert problem.startswith("modules_to_save=['lm_head'] is not supported by ")


@pytest.mark.parametrize("change", [{"use_rslora": True}, {"target_modules": ".*_proj"}])
def test_what_sglang_alone_refuses(adapter_copy, change):
    """SGLang 0.5.23 scales by lora_alpha/r (``LoRAAdapter.scaling``) and takes a string
    target_modules only as "all"/"all-linear" (``get_normalized_target_modules``)."""
    _edit_config(adapter_copy, **change)
    assert validate_adapter_dir(adapter_copy).ok
    assert validate_adapter_dir(adapter_copy, engine="vllm").ok
    assert len(validate_adapter_dir(adapter_copy, engine="sglang").problems) == 1


def test_bundle_validate_takes_the_engine_kind(peft_dir):
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    cfg["use_rslora"] = True
    bundle = AdapterBundle.from_dir(peft_dir, name="p", version=1, config=cfg)
    assert bundle.validate().ok
    assert (
        "use_rslora=true is not supported by SGLang" in bundle.validate(engine="sglang").problems[0]
    )


def test_inspect_engine_option(adapter_copy):
    _edit_config(adapter_copy, use_rslora=True)

    def inspect(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "lorafleet", "inspect", str(adapter_copy), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    r = inspect("--json")
    assert r.returncode == 0 and json.loads(r.stdout)["rules"] == "shared"
    r = inspect("--engine", "sglang")
    assert r.returncode == 1
    assert "rules:       SGLang 0.5.23" in r.stdout
    assert "use_rslora=true is not supported by SGLang" in r.stdout
    assert inspect("--engine", "tgi").returncode == 2
