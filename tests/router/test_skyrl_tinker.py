"""SkyRL's Tinker server samples from many checkpoints through lorafleet, unmodified.

SkyRL 0.4.0's ``skyrl.tinker.extra.external_inference.ExternalInferenceClient`` is what its
Tinker API server uses to sample from an external vLLM: it unpacks each sampler checkpoint into
``external_inference_lora_base/<model_id>_<checkpoint_id>/`` and posts ``/v1/completions`` for
that name, counting on vLLM's filesystem resolver to load it. Pointed at lorafleet's router
instead, whose ``--watch-dir`` is that directory, it samples from 8 checkpoints on a fleet with
4 adapter slots (2 reference replicas of 2): token-id prompts, ``n``, ``logprobs``,
``prompt_logprobs`` and ``X-Session-ID`` as the client sends them. Every sample equals what the
checkpoint's adapter answers loaded directly into an engine of its own; no engine ever holds
more than its slots. The client runs in SkyRL's own Python 3.12 venv (scripts/setup-skyrl.sh),
through the entry point the Tinker server calls (``call_and_store_result``).
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from lorafleet.launch import Launcher
from lorafleet.testing import make_peft_adapter, start_reference_engine
from tests.front.skyrl_helpers import run_driver, skyrl_venv

pytestmark = pytest.mark.timeout(900)

DRIVER = Path(__file__).with_name("skyrl_tinker_driver.py")
SLOTS = 2
MODEL_ID = "run-7f3a"
CHECKPOINTS = [f"ckpt-{i:03d}" for i in range(8)]
KEY = "tinker-inference-key"
PROMPT = [64, 139, 286, 481, 318]


def _request(ckpt: str, seq: int) -> dict:
    """Even ``seq``: greedy, one sample, with prompt logprobs (vLLM refuses ``n`` > 1 when
    greedy); odd: two seeded samples at temperature 1."""
    greedy = seq % 2 == 0
    params = {"max_tokens": 4, "temperature": 0.0 if greedy else 1.0, "seed": None if greedy else 7}
    return {
        "checkpoint": ckpt,
        "request": {
            "num_samples": 1 if greedy else 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": params,
            "sampling_session_id": "session-1",
            "seq_id": seq,
            "prompt_logprobs": greedy,
        },
    }


def _direct_body(req: dict) -> dict:
    """The completion SkyRL's client sends for ``req``, as a direct load is asked it."""
    r = req["request"]
    return {
        "model": f"{MODEL_ID}_{req['checkpoint']}",
        "prompt": PROMPT,
        "n": r["num_samples"],
        "seed": r["sampling_params"]["seed"],
        "max_tokens": 4,
        "temperature": r["sampling_params"]["temperature"],
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": True,
        "return_token_ids": True,
    }


def test_skyrl_tinker_samples_eight_checkpoints_on_four_slots(
    tiny_model, make_fleet, tmp_path, tmp_path_factory
):
    venv = skyrl_venv()
    made = {
        ckpt: make_peft_adapter(tiny_model, tmp_path / "made" / ckpt, r=8, seed=500 + i)
        for i, ckpt in enumerate(CHECKPOINTS)
    }
    lora_base = tmp_path / "lora_models"
    lora_base.mkdir()
    # Two passes over the checkpoints in a shuffled order, four requests at a time: the
    # second pass finds most of them evicted again (8 names, 4 slots).
    rng = random.Random(3)
    order = [*CHECKPOINTS, *rng.sample(CHECKPOINTS, len(CHECKPOINTS))]
    requests = [_request(c, seq) for seq, c in enumerate(order)]
    with Launcher(tmp_path / "logs") as launcher:
        # What each request gets from its checkpoint loaded directly into an engine of its own.
        direct = start_reference_engine(launcher, tiny_model, max_loras=len(made))
        for ckpt, path in made.items():
            r = httpx.post(
                direct.url + "/v1/load_lora_adapter",
                json={"lora_name": f"{MODEL_ID}_{ckpt}", "lora_path": str(path)},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        expected: list[list[list[int]]] = []
        for req in requests:
            r = httpx.post(direct.url + "/v1/completions", json=_direct_body(req), timeout=60)
            assert r.status_code == 200, r.text
            expected.append([c["token_ids"] for c in r.json()["choices"]])
        assert len({str(e) for e in expected}) > len(expected) // 2

        fleet = make_fleet(launcher, 2, max_loras=SLOTS, shared=tmp_path, router=False)
        fleet.router = fleet.start_router(
            state_dir=tmp_path_factory.mktemp("tinker-router"),
            api_key=KEY,
            extra=("--watch-dir", str(lora_base)),
        )
        waves = [list(range(k, min(k + 4, len(requests)))) for k in range(0, len(requests), 4)]
        plan = {
            "url": fleet.router.url,
            "api_key": KEY,
            "base_model": "tiny",
            "model_id": MODEL_ID,
            "checkpoints_base": str(tmp_path / "checkpoints"),
            "lora_base": str(lora_base),
            "checkpoints": {c: str(p) for c, p in made.items()},
            "requests": requests,
            "waves": waves,
        }

        with fleet.watch_slots(SLOTS) as over:
            out = run_driver(venv, tmp_path / "stand-in", plan, tmp_path, driver=DRIVER)

        results = out["results"]
        assert len(results) == len(requests)
        for k, req in enumerate(requests):
            got = results[str(k)]
            assert got["status"] == "completed", got
            sample = got["result"]
            seqs = sample["sequences"]
            assert [s["tokens"] for s in seqs] == expected[k], (req, expected[k])
            for s in seqs:
                assert len(s["logprobs"]) == len(s["tokens"])
                assert all(isinstance(x, float) and x <= 0 for x in s["logprobs"])
            if req["request"]["prompt_logprobs"]:
                lp = sample["prompt_logprobs"]
                assert lp is not None and len(lp) == len(PROMPT), lp
            else:
                assert sample["prompt_logprobs"] is None
        assert not over, f"an engine held more than {SLOTS} adapters: {over[:3]}"
        # Each checkpoint was registered once, by the request that named it first.
        table = fleet.aliases()
        for ckpt in CHECKPOINTS:
            assert table[f"{MODEL_ID}_{ckpt}"]["version"] == 1
        assert fleet.staging_bytes() == [0] * len(fleet.agents)
        # The client's X-Session-ID reached the router's sessions.
        metrics = httpx.get(fleet.router.url + "/metrics", timeout=10).text
        sessions = next(
            float(x.split()[-1])
            for x in metrics.splitlines()
            if x.startswith("lorafleet_router_sessions ")
        )
        assert sessions >= 1
