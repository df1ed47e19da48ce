"""SkyRL 0.4.0's own ``RemoteInferenceClient``, unmodified, driving LoRA sync rounds at a front.

Run by tests/front/test_skyrl.py in SkyRL's Python 3.12 venv (scripts/setup-skyrl.sh), never
imported by the suite: ``python skyrl_driver.py plan.json out.json``. SkyRL's client names torch
types in annotations only, so the test puts a minimal import-time stand-in for ``torch`` on
``PYTHONPATH`` (no real torch exists for 3.12 here); nothing in this script uses torch.

Each round does what SkyRL's trainer does for a non-colocated LoRA sync: pause (keep), write the
new adapter into the same ``lora_sync_path`` directory, ``load_lora_adapter("skyrl-lora",
path)``, resume, reset the prefix cache, then generate with sessions. A round marked ``bad``
writes an adapter that cannot be published: its load must raise and the previous weights must
keep serving. Sessions: one started in round k is asked again in round k+1 (it must stay on its
version), then finished, then asked again (it must move to the newest).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import aiohttp
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    SKYRL_LORA_ADAPTER_NAME,
    RemoteInferenceClient,
)


def _status(exc: BaseException) -> int | None:
    return exc.status if isinstance(exc, aiohttp.ClientResponseError) else None


async def main(plan: dict) -> dict:
    url = plan["url"]
    client = RemoteInferenceClient(
        proxy_url=url,
        server_urls=[url],
        data_parallel_size=1,
        model_name=plan["model_name"],
        uses_lora_weight_sync=True,
    )
    gen = client._get_generate_client()  # SkyRL's own raw-token client (it keeps the raw answer)
    sync_dir = Path(plan["sync_dir"])
    sp = {"max_tokens": plan["max_tokens"], "temperature": 0.0, "logprobs": 0}
    out: dict = {"rounds": []}
    out["world_size"] = list(await client.get_world_size())
    prompt_ids = (await client.tokenize([plan["prompt"]]))[0]
    out["prompt_ids"] = prompt_ids

    async def raw(session: str) -> dict:
        r = await gen.generate(
            prompt_token_ids=prompt_ids,
            sampling_params=sp,
            session_id=session,
            model=SKYRL_LORA_ADAPTER_NAME,
        )
        return {"ids": r.response_ids, "version": r.raw_response["lorafleet"]["version"]}

    previous_session = None
    for k, rnd in enumerate(plan["rounds"]):
        rec: dict = {"bad": rnd.get("bad", False)}
        rec["pause"] = await client.pause(mode="keep", clear_cache=False)
        # The trainer overwrites the same files in the same directory every sync.
        sync_dir.mkdir(parents=True, exist_ok=True)
        for f in Path(rnd["adapter"]).iterdir():
            shutil.copyfile(f, sync_dir / f.name)
        try:
            loaded = await client.load_lora_adapter(SKYRL_LORA_ADAPTER_NAME, str(sync_dir))
            rec["load"] = {"ok": True, "body": json.loads(loaded[url]["body"])}
        except Exception as exc:
            rec["load"] = {"ok": False, "status": _status(exc), "error": str(exc)}
        rec["resume"] = await client.resume()
        rec["reset"] = await client.reset_prefix_cache(reset_running_requests=True)
        if rec["load"]["ok"]:
            client.increment_weight_version()
        batch = await client.generate(
            {
                "prompt_token_ids": [prompt_ids, prompt_ids],
                "sampling_params": sp,
                "session_ids": [f"ep{k}-a", f"ep{k}-b"],
            },
            model=SKYRL_LORA_ADAPTER_NAME,
        )
        rec["generate"] = {
            "ids": batch["response_ids"],
            "logprobs": batch["response_logprobs"],
            "text": batch["responses"],
            "stop": batch["stop_reasons"],
        }
        rec["session"] = await raw(f"ep{k}-a")
        if previous_session is not None:
            rec["old_session"] = await raw(previous_session)
            await client.finish_session(previous_session)
            rec["old_session_after_finish"] = await raw(previous_session)
        previous_session = f"ep{k}-a"
        out["rounds"].append(rec)

    out["unload"] = await client.unload_lora_adapter(SKYRL_LORA_ADAPTER_NAME)
    try:
        await raw("after-unload")
        out["after_unload"] = {"ok": True}
    except Exception as exc:
        out["after_unload"] = {"ok": False, "status": _status(exc), "error": str(exc)}
    try:
        await client.load_lora_adapter(SKYRL_LORA_ADAPTER_NAME, in_memory=True)
        out["in_memory"] = {"ok": True}
    except Exception as exc:
        out["in_memory"] = {"ok": False, "status": _status(exc), "error": str(exc)}
    await client.teardown()
    return out


if __name__ == "__main__":
    plan = json.loads(Path(sys.argv[1]).read_text())
    result = asyncio.run(main(plan))
    Path(sys.argv[2]).write_text(json.dumps(result, default=str))
