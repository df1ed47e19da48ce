from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def peft_dir(tiny_model, tmp_path_factory) -> Path:
    """A real PEFT adapter (r=8, q/k/v/o, random weights) written by save_pretrained."""
    from lorafleet.testing import make_peft_adapter

    return make_peft_adapter(tiny_model, tmp_path_factory.mktemp("peft") / "adapter", r=8, seed=1)


@pytest.fixture
def adapter_copy(peft_dir, tmp_path) -> Path:
    """A writable copy of ``peft_dir`` to break in a test."""
    out = tmp_path / "adapter"
    shutil.copytree(peft_dir, out)
    return out
