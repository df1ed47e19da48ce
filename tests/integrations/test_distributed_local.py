"""``lorafleet.integrations.distributed`` in one process: plans, keys and the error hand-over.

The two-process behaviour (gathers, broadcasts, a real fleet) is in test_distributed.py.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from lorafleet.errors import AdapterInvalid, EngineRejected, PublishError, VersionConflict
from lorafleet.integrations.distributed import (
    _checkpoint_key,
    _dumps,
    _peft_model,
    _plan,
    publish,
)


class NeedsKeywords(Exception):
    """An exception whose constructor pickle cannot call, with an attribute pickle refuses."""

    def __init__(self, message: str, *, replica: str) -> None:
        super().__init__(message)
        self.replica = replica
        self.lock = threading.Lock()


def handed_over(exc: BaseException) -> BaseException:
    """What another rank raises: pickled on the failing rank, unpickled on another."""
    return pickle.loads(_dumps(exc, rank=0))


@pytest.mark.parametrize(
    "exc",
    [
        PublishError("publication failed", {"replica-1": "422 adapter_invalid: rank 32 > 16"}),
        VersionConflict("version 3 is not newer than 4"),
        EngineRejected("the engine said no", engine_status=400),
        AdapterInvalid(["rank 64 > 16", "unknown module"], path="adapter"),
        ValueError("plain"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_keep_their_class_message_and_attributes_across_ranks(exc) -> None:
    other = handed_over(exc)
    assert type(other) is type(exc)
    assert str(other) == str(exc)
    for attr in ("failures", "code", "engine_status", "problems", "path"):
        assert getattr(other, attr, None) == getattr(exc, attr, None)
    assert "raised on rank 0" in "".join(getattr(other, "__notes__", []))


def test_an_error_pickle_cannot_rebuild_still_crosses() -> None:
    other = handed_over(NeedsKeywords("agent down", replica="r1"))
    assert type(other) is NeedsKeywords
    assert str(other) == "agent down" and other.replica == "r1"
    assert not hasattr(other, "lock")  # not picklable: left behind, not fatal


def test_an_error_class_the_other_rank_cannot_import_becomes_a_runtime_error() -> None:
    class Local(Exception):
        pass

    other = handed_over(Local("only here"))
    assert type(other) is RuntimeError
    assert "Local" in str(other) and "only here" in str(other)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("base_model.model.l.0.q_proj.lora_A.weight", "base_model.model.l.0.q_proj.lora_A.weight"),
        (
            "base_model.model.l.0._fsdp_wrapped_module.q_proj.lora_A.default._fsdp_wrapped_module"
            ".weight",
            "base_model.model.l.0.q_proj.lora_A.weight",
        ),
        (
            "m._checkpoint_wrapped_module.q.lora_magnitude_vector.default",
            "m.q.lora_magnitude_vector",
        ),
        ("_orig_mod.m.default_layer.lora_B.weight", "m.default_layer.lora_B.weight"),
    ],
)
def test_wrapper_segments_and_the_adapter_name_leave_checkpoint_keys(raw: str, key: str) -> None:
    assert _checkpoint_key(raw, "default") == key


def test_plan_of_a_plain_model_is_pefts_own_state_dict(tiny_model: Path) -> None:
    import torch
    from peft import get_peft_model_state_dict

    from lorafleet.integrations.distributed import _gather
    from lorafleet.testing import make_peft_model

    model = make_peft_model(tiny_model, r=4)
    plan = _plan(model, "default")
    assert plan.kind == "local"
    tensors, failure = _gather(plan, dst=0)
    assert failure is None
    expected = get_peft_model_state_dict(model)
    assert set(tensors) == set(expected)
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert plan.config["r"] == 4


def test_wrappers_are_looked_through_and_non_peft_models_refused(tiny_model: Path) -> None:
    import torch

    from lorafleet.testing import make_peft_model

    model = make_peft_model(tiny_model, r=4)

    class Wrapper(torch.nn.Module):  # DDP and accelerate keep the model in .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    assert _peft_model(Wrapper(Wrapper(model))) is model
    with pytest.raises(TypeError, match="PEFT model"):
        _peft_model(torch.nn.Linear(2, 2))


class RecordingPublisher:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def publish(self, source, *, name, **kwargs):
        self.calls.append((source, name, kwargs))
        return "result"


def test_without_a_process_group_it_publishes_the_gathered_state_dict(tiny_model: Path) -> None:
    from peft import get_peft_model_state_dict

    from lorafleet.testing import make_peft_model

    model = make_peft_model(tiny_model, r=4)
    pub = RecordingPublisher()
    assert publish(model, pub, name="policy", mode="in_place") == "result"
    [(source, name, kwargs)] = pub.calls
    assert name == "policy" and kwargs["mode"] == "in_place"
    assert set(source) == set(get_peft_model_state_dict(model))
    assert kwargs["config"]["r"] == 4

    state = {"x.lora_A.weight": 0}
    publish(state, pub, name="native", config={"r": 4})
    assert pub.calls[-1] == (state, "native", {"config": {"r": 4}})

    with pytest.raises(ValueError, match="needs a Publisher"):
        publish(model, None, name="policy")


def test_the_core_still_imports_without_torch() -> None:
    code = (
        "import sys, lorafleet.publisher, lorafleet.bundle, lorafleet.integrations; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 129])
def test_shard_rows_follow_torch_chunk(rows: int, ranks: int) -> None:
    """The batched gather cuts rows as DTensor's Shard(0) and FSDP2 do: ``torch.chunk``."""
    import torch

    from lorafleet.integrations.distributed import _shard0_rows

    chunks = [c.shape[0] for c in torch.arange(rows).chunk(ranks)]
    assert _shard0_rows(rows, ranks) == chunks + [0] * (ranks - len(chunks))


def test_an_outcome_that_cannot_be_pickled_still_reaches_the_other_ranks() -> None:
    from lorafleet.integrations.distributed import _payload

    payload, substitute = _payload(threading.Lock(), rank=0)  # a result pickle refuses
    other = pickle.loads(payload)
    assert type(other) is RuntimeError and "could not send its outcome" in str(other)
    assert type(substitute) is RuntimeError and str(substitute) == str(other)  # raised there too
    # An exception travels as itself, noting its rank; a picklable result as itself.
    sent = pickle.loads(_payload(ValueError("x"), rank=0)[0])
    assert type(sent) is ValueError and "raised on rank 0" in "".join(sent.__notes__)
    assert pickle.loads(_payload({"version": 3}, rank=0)[0]) == {"version": 3}
    assert _payload({"version": 3}, rank=0)[1] is None
