"""AReaL 1.0.4's own ``RemoteSGLangEngine`` and ``RemotevLLMEngine``, unmodified, from the package,
against the front (``--dialect sglang`` / ``--dialect vllm``) over 2 reference replicas.

Each runs in the AReaL venv (scripts/setup-areal.sh) as a subprocess, driven by
``areal_driver.py`` through the disk weight-update steps as AReaL's trainer runs them: pause,
update from disk, continue, set version, generate; version 0 is the base model. Every greedy
output must equal the adapter's own (PEFT merged in transformers), and a long rollout that a
pause aborts mid-generation must come back whole after the update, resent by the engine itself.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from lorafleet.front.service import FrontConfig
from lorafleet.launch import Launcher
from lorafleet.testing import make_peft_adapter
from tests.front.conftest import FrontServers

DRIVER = Path(__file__).with_name("areal_driver.py")
PROMPT = "The quick brown fox"
MAX_TOKENS = 8
ABORT_TOKENS = 160  # long enough to be in flight when the pause lands (~1.5 s on the tiny model)


def _areal_venv() -> Path:
    if venv := os.environ.get("LORAFLEET_AREAL_VENV"):
        return Path(venv)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lorafleet" / "venv-areal-1.0.4"


@pytest.fixture(scope="module")
def areal_python() -> Path:
    if os.environ.get("LORAFLEET_SKIP_AREAL") == "1":
        pytest.skip("AReaL tier off: LORAFLEET_SKIP_AREAL=1")
    venv = _areal_venv()
    if not (venv / ".lorafleet-ready").is_file():
        pytest.skip(f"AReaL tier off: no finished venv at {venv} (scripts/setup-areal.sh)")
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def fleet(make_fleet, tmp_path_factory):
    """2 reference replicas and a router, shared by the module; agents allow ``shared``."""
    shared = tmp_path_factory.mktemp("areal-shared")
    with Launcher(tmp_path_factory.mktemp("areal-logs")) as launcher:
        yield make_fleet(launcher, 2, shared=shared), shared


@pytest.fixture(scope="module")
def fronts():
    servers = FrontServers()
    yield servers
    servers.stop()


def greedy_ids(model: Path, adapter: Path | None, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy continuation of ``prompt_ids`` with the adapter merged (float32, transformers)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32)
    if adapter is not None:
        m = PeftModel.from_pretrained(m, str(adapter)).merge_and_unload()
    m.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0][len(prompt_ids) :].tolist()


def run_driver(python: Path, args: dict) -> dict:
    proc = subprocess.run(
        [str(python), str(DRIVER), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_areal_remote_engine_disk_updates(
    dialect, areal_python, fleet, fronts, tiny_model, tmp_path
):
    from transformers import AutoTokenizer

    fl, shared = fleet
    cfg = FrontConfig(
        agents=fl.agent_urls,
        router=fl.router.url,
        shared_dirs=[shared],
        fleet_token=fl.token,
        allow_unauthenticated_control=True,  # AReaL sends no token
        dialect=dialect,
    )
    url = fronts.start(cfg)
    front = fronts.apps[url].state.front
    lora = f"areal-{dialect}"
    a1 = make_peft_adapter(tiny_model, tmp_path / "a1", seed=11)
    a2 = make_peft_adapter(tiny_model, tmp_path / "a2", seed=12)
    prompt_ids = AutoTokenizer.from_pretrained(str(tiny_model))(PROMPT).input_ids
    adapters = {0: None, 1: a1, 2: a2}
    want = {v: greedy_ids(tiny_model, a, prompt_ids, MAX_TOKENS) for v, a in adapters.items()}
    assert len({tuple(w) for w in want.values()}) == 3

    out = run_driver(
        areal_python,
        {
            "backend": dialect,
            "addr": url.removeprefix("http://"),
            "tokenizer": str(tiny_model),
            "lora_name": lora,
            "trial": f"t-{dialect}",
            "fileroot": str(shared / f"areal-{dialect}"),
            "records": str(tmp_path / "name_resolve"),
            "adapters": {"1": str(a1), "2": str(a2)},
            "prompt_ids": prompt_ids,
            "max_new_tokens": MAX_TOKENS,
            "abort_tokens": ABORT_TOKENS,
            "abort_after_s": 0.4,
        },
    )
    for step in out["steps"]:
        v = step["version"]
        assert step["tokens"] == want[v], (v, step)
        assert step["versions"] == [v] * MAX_TOKENS
        assert step["stop"] == "length"
        assert all(isinstance(x, float) and x <= 0 for x in step["logprobs"])
    # The engine deleted each directory right after its load answered: the front had the bytes.
    assert out["deleted"] == [1, 2]

    # The pause ended the long rollout in flight (front.gate aborted it); the engine resent it
    # after the update and got the whole answer, from the version then current.
    assert front.gate.aborted_total == 1
    rollout = out["aborted_rollout"]
    whole = greedy_ids(tiny_model, a2, prompt_ids, ABORT_TOKENS)
    assert rollout["tokens"] == whole, (len(rollout["tokens"]), len(whole), rollout["stop"])
    assert rollout["stop"] == ("length" if len(whole) == ABORT_TOKENS else "stop")
    assert set(rollout["versions"]) == {2}

    # What the fleet holds: both versions of the name, routable by the router's pins.
    table = httpx.get(f"{fl.router.url}/v1/models", timeout=10).json()
    ids = {m["id"] for m in table["data"]}
    assert {f"{lora}@v1", f"{lora}@v2"} <= ids or lora in ids
