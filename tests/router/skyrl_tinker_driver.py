"""Runs SkyRL's Tinker server's ExternalInferenceClient, unmodified, against lorafleet's router.

Executed with SkyRL's Python 3.12 venv (tests/router/test_skyrl_tinker.py). Usage:
``python skyrl_tinker_driver.py PLAN.json OUT.json``. The plan names the router, its key,
SkyRL's checkpoint and LoRA directories, the sampler checkpoints to write (adapter directories,
packed with SkyRL's own ``pack_and_upload`` as its trainer saves sampler weights) and the
sample requests. Every request goes through ``ExternalInferenceClient.call_and_store_result``,
the entry point the Tinker API server calls, with a future store that records the result.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

from cloudpathlib import AnyPath
from skyrl.tinker.api import SampleRequest
from skyrl.tinker.config import EngineConfig
from skyrl.tinker.extra.external_inference import ExternalInferenceClient
from skyrl.utils.storage import pack_and_upload


class Store:
    """What the Tinker server's external future store does with a result: keep it."""

    def __init__(self) -> None:
        self.results: dict[int, dict] = {}

    async def complete(self, request_id, result, status) -> None:
        self.results[request_id] = {"status": str(status.value), "result": result.model_dump()}


async def main(plan: dict) -> dict:
    base = AnyPath(plan["checkpoints_base"])
    for ckpt, adapter_dir in plan["checkpoints"].items():
        dest = base / plan["model_id"] / "sampler_weights" / f"{ckpt}.tar.gz"
        with pack_and_upload(dest) as tmp:
            for f in Path(adapter_dir).iterdir():
                shutil.copy(f, tmp / f.name)
    cfg = EngineConfig(
        base_model=plan["base_model"],
        checkpoints_base=base,
        external_inference_url=plan["url"],
        external_inference_api_key=plan["api_key"],
        external_inference_lora_base=Path(plan["lora_base"]),
    )
    store = Store()
    client = ExternalInferenceClient(cfg, db_engine=None, external_future_store=store)

    async def one(k: int, req: dict) -> None:
        sample = SampleRequest.model_validate(req["request"])
        await client.call_and_store_result(k, sample, plan["model_id"], req["checkpoint"])

    for wave in plan["waves"]:
        await asyncio.gather(*(one(k, plan["requests"][k]) for k in wave))
    return {"results": {str(k): v for k, v in store.results.items()}}


if __name__ == "__main__":
    plan = json.loads(Path(sys.argv[1]).read_text())
    out = asyncio.run(main(plan))
    Path(sys.argv[2]).write_text(json.dumps(out))
