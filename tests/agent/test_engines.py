"""The backends end to end: engine crash + restart, SGLang dialect, real vLLM."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from lorafleet.bundle import AdapterBundle
from lorafleet.testing import start_agent, start_reference_engine, wait_until
from tests.agent.helpers import completion
from tests.agent.test_publish_flow import call, publish


def _engine_adapters(url: str) -> set[str]:
    try:
        r = httpx.get(url + "/v1/models", timeout=2)
    except httpx.HTTPError:
        return set()
    return {c["id"] for c in r.json()["data"] if c.get("parent")}


def test_engine_killed_and_restarted_is_reconciled(
    launcher, tiny_model, peft_dir, peft_dir2, tmp_path
):
    eng = start_reference_engine(launcher, tiny_model, max_lora_rank=16)
    agent = start_agent(launcher, eng, tmp_path / "agent", kind="reference")
    publish(agent, AdapterBundle.from_dir(peft_dir, name="crash", version=1))
    call(agent, lambda c: c.activate("crash", 1))
    publish(agent, AdapterBundle.from_dir(peft_dir2, name="other", version=3), mode="in_place")
    want = {"crash@v1", "other"}
    assert _engine_adapters(eng.url) == want
    before = completion(eng.url, "crash@v1")

    eng.proc.kill()  # SIGKILL
    wait_until(
        lambda: httpx.get(agent.url + "/health").status_code == 503,
        message="agent still reports ready with its engine dead",
    )
    assert httpx.get(agent.url + "/v1/info").json()["ready"] is False

    launcher.restart(eng)  # same port, no adapters; ready when it answers /health
    answered = time.monotonic()
    wait_until(lambda: _engine_adapters(eng.url) == want, message="adapters not reinstalled")
    reinstalled = time.monotonic() - answered
    wait_until(
        lambda: httpx.get(agent.url + "/health").status_code == 200,
        message="agent not ready after the reinstall",
    )
    assert completion(eng.url, "crash@v1") == before
    states = {(r.name, r.version): r.state.value for r in call(agent, lambda c: c.list_adapters())}
    assert states == {("crash", 1): "active", ("other", 3): "loaded"}
    assert "lorafleet_agent_reconciliations_total 2.0" in httpx.get(agent.url + "/metrics").text
    print(f"reinstalled {len(want)} adapters {reinstalled:.2f}s after the engine answered")


def _generate(url: str, lora: str | None) -> list[int]:
    body = {
        "text": "The quick brown fox",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "lora_path": lora,
    }
    r = httpx.post(url + "/generate", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["output_ids"]


@pytest.mark.parametrize("upsert", [False, True])
def test_sglang_backend(launcher, engine, tmp_path, peft_dir, peft_dir2, upsert):
    _, eng = engine
    extra = ["--sglang-upsert"] if upsert else []
    agent = start_agent(launcher, eng, tmp_path / "agent", kind="sglang", extra=extra)
    info = httpx.get(agent.url + "/v1/info").json()
    assert info["capabilities"]["kind"] == "sglang" and info["capabilities"]["upsert"] is upsert
    base = _generate(eng.url, None)
    # versioned
    publish(agent, AdapterBundle.from_dir(peft_dir, name="sg", version=1))
    v1 = _generate(eng.url, "sg@v1")
    assert v1 != base
    # in place, twice: the plain name follows the newest version
    publish(agent, AdapterBundle.from_dir(peft_dir, name="sgp", version=1), mode="in_place")
    assert _generate(eng.url, "sgp") == v1
    publish(agent, AdapterBundle.from_dir(peft_dir2, name="sgp", version=2), mode="in_place")
    assert _generate(eng.url, "sgp") not in (v1, base)
    for name, v in (("sg", 1), ("sgp", 1), ("sgp", 2)):
        call(agent, lambda c, name=name, v=v: c.unload(name, v))
    assert _engine_adapters(eng.url) == set()


@pytest.mark.parametrize(
    "server", ["sglang_reference_engine", pytest.param("sglang_server", marks=pytest.mark.sglang)]
)
def test_sglang_backend_as_real_sglang(request, launcher, tmp_path, peft_dir, peft_dir2, server):
    """Against real SGLang 0.5.23 and the reference engine's copy of it: the agent reads the
    limits from ``/server_info``, and in place serves each new version although SGLang has no
    upsert and re-loads a remembered name from its old path (the agent re-points that path)."""
    eng = request.getfixturevalue(server)
    agent = start_agent(launcher, eng, tmp_path / "agent", kind="sglang")
    caps = httpx.get(agent.url + "/v1/info").json()["capabilities"]
    assert (caps["max_lora_rank"], caps["max_loras_per_batch"]) == (16, 8)
    assert caps["upsert"] is False and caps["lora_target_modules"]
    name = "inplace-agent"  # remembered by the session's server forever: used nowhere else
    base = _generate(eng.url, None)
    publish(agent, AdapterBundle.from_dir(peft_dir, name=name, version=1), mode="in_place")
    v1 = _generate(eng.url, name)
    assert v1 != base
    publish(agent, AdapterBundle.from_dir(peft_dir2, name=name, version=2), mode="in_place")
    v2 = _generate(eng.url, name)
    assert v2 not in (v1, base)
    for v in (1, 2):
        call(agent, lambda c, v=v: c.unload(name, v))
    assert name not in _engine_adapters(eng.url)


def test_sglang_upsert_ignored_is_refused(launcher, sglang_reference_engine, tmp_path, peft_dir):
    """--sglang-upsert in front of stock SGLang (which ignores the field and answers 'already
    loaded') must fail the load, not leave the old weights serving under the name."""
    eng = sglang_reference_engine
    agent = start_agent(launcher, eng, tmp_path / "agent", kind="sglang", extra=["--sglang-upsert"])
    name = "upsert-ignored"
    publish(agent, AdapterBundle.from_dir(peft_dir, name=name, version=1), mode="in_place")
    with pytest.raises(Exception, match="ignored upsert"):
        publish(agent, AdapterBundle.from_dir(peft_dir, name=name, version=2), mode="in_place")
    for v in (1, 2):
        with contextlib.suppress(Exception):
            call(agent, lambda c, v=v: c.unload(name, v))


@pytest.mark.vllm
def test_vllm_backend_end_to_end(launcher, vllm_server, tmp_path, peft_dir, peft_dir2):
    agent = start_agent(launcher, vllm_server, tmp_path / "agent", kind="vllm")
    caps = httpx.get(agent.url + "/v1/info").json()["capabilities"]
    assert caps["kind"] == "vllm" and caps["unload_frees_slot"] is False
    base = completion(vllm_server.url, "tiny")
    publish(agent, AdapterBundle.from_dir(peft_dir, name="vl", version=1))
    out1 = completion(vllm_server.url, "vl@v1")
    assert out1 != base
    publish(agent, AdapterBundle.from_dir(peft_dir2, name="vl", version=2))
    call(agent, lambda c: c.activate("vl", 2))
    assert completion(vllm_server.url, "vl@v2") not in (out1, base)
    # in place: load_inplace under the plain name, each version from its own path
    publish(agent, AdapterBundle.from_dir(peft_dir, name="vlp", version=1), mode="in_place")
    assert completion(vllm_server.url, "vlp") == out1
    publish(agent, AdapterBundle.from_dir(peft_dir2, name="vlp", version=2), mode="in_place")
    assert completion(vllm_server.url, "vlp") != out1
    for name, v in (("vl", 1), ("vl", 2), ("vlp", 1), ("vlp", 2)):
        call(agent, lambda c, name=name, v=v: c.unload(name, v))
    assert _engine_adapters(vllm_server.url) == set()
    assert list((agent.spec.data_dir / "blobs" / "sha256").iterdir()) == []


def test_engine_probes_stay_out_of_the_info_log(agent):
    """The reconciler lists the engine's adapters twice a second; at the default log level
    those requests must not fill the agent's log (they appear with --log-level debug)."""
    import httpx

    assert httpx.get(agent.url + "/health", timeout=10).status_code == 200  # probed and listed
    log = agent.proc.log_path.read_text()
    assert "Application startup complete" in log  # this is the agent's log, at INFO
    assert "HTTP Request" not in log
