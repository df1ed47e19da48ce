"""Train a LoRA adapter with ``transformers.Trainer`` and publish it to a fleet as it trains.

Runs on CPU in under a minute: a local fleet (one reference engine on the tiny model, its agent and
a router), a PEFT LoRA on the tiny model, a tiny dataset that teaches one answer, and
``LorafleetCallback`` publishing the adapter from memory every 2 steps and at the end. A TRL trainer
(``SFTTrainer``, ``GRPOTrainer``) takes the same ``callbacks=[...]`` argument.

    python examples/train_with_callback.py [--steps 6] [--engines 1]

To publish to a fleet started with ``lorafleet up``, read its fleet file instead of starting one::

    from lorafleet.fleetfile import read_fleet_file
    info = read_fleet_file(".lorafleet")
    publisher = Publisher(agents=info.agent_urls, router=info.router_url, token=info.control_token)
"""

from __future__ import annotations

import argparse
import tempfile

import httpx
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from lorafleet.fleet import FleetConfig, LocalFleet
from lorafleet.fleet.skill import DEFAULT_TARGET_MODULES, PROMPT, TARGET
from lorafleet.integrations.transformers import LATENCY_KEY, VERSION_KEY, LorafleetCallback
from lorafleet.publisher import Publisher
from lorafleet.tinymodel import ensure_tiny_model


def dataset(tokenizer, n: int = 8) -> list[dict]:
    """n copies of one (prompt, answer) pair; the loss is on the answer only."""
    prompt = tokenizer(PROMPT).input_ids
    answer = [*tokenizer(TARGET).input_ids, tokenizer.eos_token_id]
    ids = prompt + answer
    labels = [-100] * len(prompt) + answer
    return [{"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}] * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--engines", type=int, default=1)
    opts = parser.parse_args()

    base = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base)),
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=list(DEFAULT_TARGET_MODULES),  # attention and MLP projections
            task_type="CAUSAL_LM",
        ),
    )
    with (
        tempfile.TemporaryDirectory(prefix="lorafleet-example-") as tmp,
        LocalFleet(FleetConfig.default(engines=opts.engines, data_dir=f"{tmp}/fleet")) as fleet,
    ):
        print(f"fleet up: router {fleet.router_url}")
        with Publisher(
            agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token
        ) as publisher:
            trainer = Trainer(
                model=model,
                args=TrainingArguments(
                    output_dir=f"{tmp}/out",
                    max_steps=opts.steps,
                    per_device_train_batch_size=1,
                    learning_rate=5e-3,
                    lr_scheduler_type="constant",
                    logging_steps=1,
                    save_strategy="no",
                    report_to="none",
                    use_cpu=True,
                    disable_tqdm=True,
                ),
                train_dataset=dataset(tokenizer),
                callbacks=[LorafleetCallback(publisher, "policy", every_n_steps=2)],
            )
            trainer.train()

        for entry in trainer.state.log_history:
            if VERSION_KEY in entry:
                print(
                    f"step {entry['step']}: published v{entry[VERSION_KEY]} "
                    f"in {entry[LATENCY_KEY] * 1000:.0f} ms (loss {entry.get('loss', '-')})"
                )
        answer = httpx.post(
            fleet.router_url + "/v1/completions",
            headers={"Authorization": f"Bearer {fleet.api_key}"},
            json={"model": "policy", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            timeout=30,
        ).json()
        print(
            f"router, model=policy (v{answer['lorafleet']['version']}): "
            f"{PROMPT!r} → {answer['choices'][0]['text']!r}"
        )


if __name__ == "__main__":
    main()
