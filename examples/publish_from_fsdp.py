"""Train a LoRA adapter sharded with FSDP2 on 2 processes and publish it to a fleet as it trains.

Runs on CPU (gloo, loopback) in about a minute::

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        examples/publish_from_fsdp.py [--steps 6] [--every 2]

Rank 0 starts a local fleet (one reference engine on the tiny model, its agent, a router) and
holds the ``Publisher``; the other rank passes ``None``. Every rank calls
``distributed.publish`` at the same step: only the LoRA parameters are gathered to rank 0, which
publishes them from memory; every rank gets the same ``PublishResult``. The base weights stay
sharded throughout.

With a fleet started by ``lorafleet up``, build the Publisher on rank 0 from its fleet file::

    from lorafleet.fleetfile import read_fleet_file
    info = read_fleet_file(".lorafleet")
    publisher = Publisher(agents=info.agent_urls, router=info.router_url, token=info.control_token)
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile

import httpx
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet.fleet import FleetConfig, LocalFleet
from lorafleet.fleet.skill import DEFAULT_TARGET_MODULES, PROMPT, TARGET
from lorafleet.integrations import distributed
from lorafleet.publisher import Publisher
from lorafleet.tinymodel import ensure_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    opts = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial LoRA weights on every rank

    base = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base)),
        LoraConfig(r=8, lora_alpha=16, target_modules=list(DEFAULT_TARGET_MODULES)),
    )
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)

    prompt = tokenizer(PROMPT).input_ids
    answer = [*tokenizer(TARGET).input_ids, tokenizer.eos_token_id]
    ids = torch.tensor([prompt + answer])
    labels = torch.tensor([[-100] * len(prompt) + answer])

    with contextlib.ExitStack() as stack:
        publisher = fleet = None
        if rank == 0:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="lorafleet-fsdp-"))
            fleet = stack.enter_context(
                LocalFleet(FleetConfig.default(engines=1, data_dir=f"{tmp}/fleet"))
            )
            publisher = stack.enter_context(
                Publisher(agents=fleet.agent_urls, router=fleet.router_url, token=fleet.token)
            )
            print(f"fleet up: router {fleet.router_url}", flush=True)
        dist.barrier()  # the other ranks wait for the fleet

        for step in range(1, opts.steps + 1):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % opts.every == 0 or step == opts.steps:
                result = distributed.publish(model, publisher, name="policy")  # every rank
                print(
                    f"rank {rank} step {step}: loss {loss.item():.3f}, published "
                    f"v{result.version} in {result.duration_s * 1000:.0f} ms",
                    flush=True,
                )

        if fleet is not None:
            out = httpx.post(
                fleet.router_url + "/v1/completions",
                headers={"Authorization": f"Bearer {fleet.api_key}"},
                json={"model": "policy", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                timeout=30,
            ).json()
            print(
                f"router, model=policy (v{out['lorafleet']['version']}): "
                f"{PROMPT!r} → {out['choices'][0]['text']!r}",
                flush=True,
            )
        dist.barrier()  # keep the fleet up until every rank is done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
