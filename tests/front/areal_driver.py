"""AReaL 1.0.4's own remote engine, unmodified, driven through its disk weight-update steps.

Run by the AReaL venv's python (tests/front/test_areal.py), never imported by the suite: it
needs ``areal``, which lorafleet's venv does not have. One JSON argument (see ``main``); one JSON
line of results on stdout.

Each step is what AReaL's trainer does (``RLTrainer.train``,
``FSDPEngine._update_weights_from_disk``): ``rollout.pause()``; ``pause_generation()``;
``update_weights_from_disk(meta)`` (a future that waits for the trainer's save); the save (here
a copy of a PEFT adapter into ``meta.path``); the name_resolve record that says it is saved;
``fut.result()``; ``continue_generation()``; ``set_version(v)``; ``rollout.resume()``. The
engine deletes ``meta.path`` once the load has
answered (``clear_checkpoint_after_load``), as the trainer's does.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import threading
import time
from datetime import datetime

import requests


def main() -> None:
    args = json.loads(sys.argv[1])
    from areal.api.cli_args import (
        GenerationHyperparameters,
        InferenceEngineConfig,
        NameResolveConfig,
    )
    from areal.api.io_struct import ModelRequest, WeightUpdateMeta
    from areal.utils import name_resolve, names

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=args["records"]))
    if args["backend"] == "sglang":
        from areal.engine.sglang_remote import RemoteSGLangEngine as Engine
    else:
        from areal.engine.vllm_remote import RemotevLLMEngine as Engine

    exp, trial, lora = "lorafleet", args["trial"], args["lora_name"]
    config = InferenceEngineConfig(
        experiment_name=exp,
        trial_name=trial,
        use_lora=True,
        lora_name=lora,
        tokenizer_path=args["tokenizer"],
        setup_timeout=60,
        request_timeout=120,
        request_retries=1,
        pause_grace_period=0.0,
        max_concurrent_rollouts=4,
        consumer_batch_size=1,
    )
    engine = Engine(config)
    engine.initialize(addr=[args["addr"]], train_data_parallel_size=1)
    base_meta = WeightUpdateMeta.from_disk(
        exp, trial, args["fileroot"], use_lora=True, lora_name=lora, lora_keep_versions=3
    )
    results: dict = {"steps": [], "deleted": []}

    def request(max_new_tokens: int) -> ModelRequest:
        g = GenerationHyperparameters(
            max_new_tokens=max_new_tokens, greedy=True, lora_name=lora, stop_token_ids=[]
        )
        return ModelRequest(input_ids=list(args["prompt_ids"]), gconfig=g)

    def generate(max_new_tokens: int) -> dict:
        resp = asyncio.run(engine.agenerate(request(max_new_tokens)))
        return {
            "tokens": resp.output_tokens,
            "logprobs": resp.output_logprobs,
            "versions": resp.output_versions,
            "stop": resp.stop_reason,
        }

    def update(version: int, adapter: str) -> None:
        meta = base_meta.with_version(version)
        engine.pause()  # RLTrainer: self.rollout.pause()
        engine.pause_generation()
        fut = engine.update_weights_from_disk(meta)
        shutil.copytree(adapter, meta.path)  # the trainer's save
        key = names.update_weights_from_disk(exp, trial, engine.get_version())
        name_resolve.add(key, str(datetime.now().timestamp()), keepalive_ttl=120)
        fut.result()
        engine.continue_generation()
        engine.set_version(version)
        engine.resume()
        # The engine's callback removes the directory once the load answered.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not os.path.exists(meta.path):
                results["deleted"].append(version)
                break
            time.sleep(0.05)

    results["steps"].append({"version": 0, **generate(args["max_new_tokens"])})
    adapters = {int(k): v for k, v in args["adapters"].items()}
    last = max(adapters)
    for version in sorted(adapters):
        if version == last and args.get("abort_tokens"):
            # A long rollout in flight when the update starts: the pause aborts it, and the
            # engine resends prompt + what it got once the executor resumes.
            box: dict = {}

            def rollout(box: dict = box) -> None:
                box.update(generate(args["abort_tokens"]))

            worker = threading.Thread(target=rollout)
            worker.start()
            # The update starts once the rollout is in flight at the router (not after a fixed
            # sleep, which a quiet machine outruns and a busy one undershoots).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if requests.get(args["inflight_url"], timeout=10).json()["num_reqs"] > 0:
                    break
                time.sleep(0.01)
            time.sleep(args.get("abort_after_s", 0.05))
            update(version, adapters[version])
            worker.join(timeout=300)
            results["aborted_rollout"] = box
        else:
            update(version, adapters[version])
        results["steps"].append({"version": version, **generate(args["max_new_tokens"])})
    engine.destroy()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
