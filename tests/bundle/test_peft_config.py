"""What PEFT itself hands over as a config (issue 25, item 5): ``LoraConfig.to_dict()`` keeps
``PeftType.LORA`` and ``TaskType`` enums and a *set* of target modules, and a trainer may pass
the ``LoraConfig`` object itself. A bundle normalises it once, when it is built."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig, PeftType, get_peft_model_state_dict

from lorafleet.bundle import AdapterBundle
from lorafleet.errors import ManifestInvalid
from lorafleet.testing import make_peft_model


@pytest.fixture(scope="module")
def peft_model(tiny_model):
    return make_peft_model(tiny_model, r=4, seed=7, target_modules=("q_proj", "v_proj"))


def _state(peft_model) -> dict:
    return get_peft_model_state_dict(peft_model, adapter_name="default")


def test_to_dict_is_what_peft_hands_over(peft_model):
    raw = peft_model.peft_config["default"].to_dict()
    # The shapes issue 25 met: an enum (str() of it is "PeftType.LORA") and a set.
    assert isinstance(raw["peft_type"], PeftType) and str(raw["peft_type"]) != "LORA"
    assert isinstance(raw["target_modules"], set)


@pytest.mark.parametrize("form", ["to_dict", "object"])
def test_peft_config_is_normalised_once_when_the_bundle_is_built(peft_model, form):
    cfg = peft_model.peft_config["default"]
    config = cfg.to_dict() if form == "to_dict" else cfg
    bundle = AdapterBundle.from_state_dict(_state(peft_model), config, name="pc", version=1)
    assert bundle.config["peft_type"] == "LORA"
    assert type(bundle.config["peft_type"]) is str
    assert bundle.config["target_modules"] == ["q_proj", "v_proj"]
    assert bundle.config["r"] == 4
    written = json.loads(bundle.open("adapter_config.json").read())
    assert written == bundle.config
    report = bundle.validate(max_rank=16, engine="sglang")
    assert report.ok, report
    # Built from either form, the bytes and so the bundle id are the same.
    other = AdapterBundle.from_state_dict(
        _state(peft_model), cfg if form == "to_dict" else cfg.to_dict(), name="pc", version=1
    )
    assert other.manifest == bundle.manifest


def test_from_any_and_a_directory_take_the_object_too(peft_model, tmp_path):
    cfg = peft_model.peft_config["default"]
    b = AdapterBundle.from_any(_state(peft_model), name="pc", version=2, config=cfg)
    assert b.config["peft_type"] == "LORA"
    b.write_to(tmp_path / "native")
    (tmp_path / "native" / "adapter_config.json").unlink()  # a native-only directory
    d = AdapterBundle.from_dir(tmp_path / "native", name="pc", version=2, config=cfg.to_dict())
    assert d.config == b.config


def test_a_plain_lora_config_object_without_a_model(tiny_model):
    cfg = LoraConfig(r=2, target_modules={"v_proj", "q_proj"}, lora_alpha=4)
    assert AdapterBundle.from_state_dict({}, cfg, name="pc").config["target_modules"] == [
        "q_proj",
        "v_proj",
    ]


@pytest.mark.parametrize("bad", [42, "LORA", ["r", 8]])
def test_a_config_that_is_neither_is_refused(peft_model, bad):
    with pytest.raises(ManifestInvalid, match="config must be"):
        AdapterBundle.from_state_dict(_state(peft_model), bad, name="pc")
