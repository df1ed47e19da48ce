"""LorafleetCallback in a real ``transformers.Trainer`` run, publishing to a real local fleet."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lorafleet.fleet.config import FleetConfig
from lorafleet.fleet.local import LocalFleet
from lorafleet.fleet.skill import DEFAULT_TARGET_MODULES, PROMPT, TARGET

NAME = "policy"


@pytest.fixture
def fleet(tmp_path: Path, tiny_model: Path):
    # One replica is enough to prove the callback; the demo and fleet tests cover two.
    with LocalFleet(FleetConfig.default(engines=1, data_dir=tmp_path / "fleet")) as f:
        yield f


def _dataset(tokenizer, n: int = 4) -> list[dict]:
    prompt = tokenizer(PROMPT).input_ids
    answer = [*tokenizer(TARGET).input_ids, tokenizer.eos_token_id]
    ids = prompt + answer
    labels = [-100] * len(prompt) + answer
    return [{"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}] * n


def test_callback_publishes_every_n_steps_and_at_the_end(
    fleet: LocalFleet, tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer, Trainer, TrainingArguments

    from lorafleet.integrations.transformers import (
        LATENCY_KEY,
        VERSION_KEY,
        LorafleetCallback,
    )
    from lorafleet.publisher import Publisher
    from lorafleet.testing import make_peft_model, merged_greedy

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    model = make_peft_model(
        tiny_model,
        r=8,
        target_modules=DEFAULT_TARGET_MODULES,
        init_lora_weights=True,
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=5,
        per_device_train_batch_size=1,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=100,  # the callback, not the schedule, makes steps 2 and 4 log
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    with Publisher(agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token) as pub:
        callback = LorafleetCallback(pub, NAME, every_n_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(tok), callbacks=[callback])
        trainer.train()

    # Steps 2 and 4, then the end of training (step 5): three versions, in order.
    assert [r.version for r in callback.results] == [1, 2, 3]
    published = [e for e in trainer.state.log_history if VERSION_KEY in e]
    assert [(e["step"], e[VERSION_KEY]) for e in published] == [(2, 1), (4, 2), (5, 3)]
    assert all(e[LATENCY_KEY] > 0 for e in published)
    # The step-2 and step-4 values ride on the trainer's own log entries (with the loss).
    assert all("loss" in e for e in published[:2])

    # The router serves the final adapter: greedy output equals the adapter merged into base.
    adapter_dir = tmp_path / "final"
    model.save_pretrained(str(adapter_dir))
    expected = merged_greedy(tiny_model, adapter_dir, PROMPT, max_tokens=8)
    r = httpx.post(
        fleet.router_url + "/v1/completions",
        headers={"Authorization": f"Bearer {fleet.api_key}"},
        json={"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        timeout=30,
    )
    r.raise_for_status()
    body = r.json()
    assert body["lorafleet"]["version"] == 3
    assert body["choices"][0]["text"] == expected


def test_callback_refuses_a_model_without_peft() -> None:
    import torch

    from lorafleet.integrations.transformers import _unwrap

    with pytest.raises(TypeError, match="PEFT model"):
        _unwrap(torch.nn.Linear(2, 2))
