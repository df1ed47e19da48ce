"""SGLang's native ``/generate`` through the router on a real SGLang 0.5.23 replica, and the
Miles story (issue 25): rollouts in SGLang's own shape, Miles' abort calls, and a resumed run.

Every routed answer must equal SGLang's own answer for the same adapter version (token for
token, logprob for logprob) and say which version produced it, as ``meta_info.weight_version``
and in the ``lorafleet`` tag. SGLang remembers every name it loaded until it restarts, so each
test uses names no other test uses.
"""

from __future__ import annotations

import itertools
import json
import secrets
import threading

import httpx
import pytest
from peft import get_peft_model_state_dict

from lorafleet.publisher import Publisher
from lorafleet.testing import make_peft_model, start_agent, start_router, wait_until

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
IDS = [1, 45, 49, 173]
SP = {"max_new_tokens": 6, "temperature": 0}
# What an answer is compared on: all but ids, latencies, cache counts and the version stamps.
SAME = ("finish_reason", "prompt_tokens", "completion_tokens")
LOGPROBS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
            "output_top_logprobs")  # fmt: skip


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


def _direct(engine: str, body: dict) -> dict:
    httpx.post(engine + "/flush_cache", timeout=30)  # the same prefill on both sides
    r = _post(engine, body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", events[-3:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def _same(routed: dict, direct: dict, version: int) -> None:
    assert routed["text"] == direct["text"]
    assert routed["output_ids"] == direct["output_ids"]
    for k in (*SAME, *LOGPROBS):
        assert routed["meta_info"].get(k) == direct["meta_info"].get(k), k
    assert routed["meta_info"]["weight_version"] == str(version)
    assert routed["lorafleet"]["version"] == version


def _fleet(launcher, engine, tmp_path):
    token = secrets.token_urlsafe(12)
    agent = start_agent(launcher, engine, tmp_path / "agent", kind="sglang", token=token)
    router = start_router(launcher, [agent], tmp_path / "router", token=token, health_interval=0.2)
    return agent, router, token


def _unload(engine: str, names: list[str]) -> None:
    for n in names:
        httpx.post(engine + "/unload_lora_adapter", json={"lora_name": n}, timeout=30)


def test_routed_native_generate_is_sglangs_own_answer(
    sglang_server, launcher, tiny_model, tmp_path
):
    agent, router, token = _fleet(launcher, sglang_server, tmp_path)
    name, engine = "sgn-eq", sglang_server.url
    model = make_peft_model(tiny_model, r=8, seed=71)
    try:
        with Publisher([agent.url], router=router.url, token=token) as pub:
            assert pub.publish(model, name=name).version == 1
        bodies = [
            {"input_ids": IDS, "sampling_params": SP, "return_logprob": True},
            {
                "text": "The quick brown fox",
                "sampling_params": SP,
                "return_logprob": True,
                "top_logprobs_num": 2,
                "logprob_start_len": 0,
            },
            {"input_ids": IDS, "sampling_params": {**SP, "stop": ["e"]}, "rid": "sgn-rid"},
        ]
        for body in bodies:
            direct = _direct(engine, {**body, "lora_path": f"{name}@v1"})
            httpx.post(engine + "/flush_cache", timeout=30)
            r = _post(router.url, {**body, "lora_path": name})
            assert r.status_code == 200, r.text
            assert r.headers["X-Lorafleet-Adapter-Version"] == "1"
            _same(r.json(), direct, 1)
            if "rid" in body:
                assert r.json()["meta_info"]["id"] == "sgn-rid"
        base = _direct(engine, bodies[0])
        assert (
            base["output_ids"]
            != _direct(engine, {**bodies[0], "lora_path": f"{name}@v1"})["output_ids"]
        )
        # A stream: SGLang's own events, each stamped with the version. How the stream is cut
        # into events depends on timing (SGLang's and the router's), so what is compared is the
        # tokens in order (each event's cumulative ids extend the last) and the final answer.
        body = {**bodies[0], "lora_path": f"{name}@v1"}
        httpx.post(engine + "/flush_cache", timeout=30)
        direct_frames = _stream(engine, body)
        httpx.post(engine + "/flush_cache", timeout=30)
        frames = _stream(router.url, {**bodies[0], "lora_path": f"{name}-v1"})
        ids = [f["output_ids"] for f in frames]
        assert all(b[: len(a)] == a for a, b in itertools.pairwise(ids)), ids
        last, direct_last = frames[-1], direct_frames[-1]
        assert last["output_ids"] == direct_last["output_ids"]
        assert last["text"] == direct_last["text"]
        assert (
            last["meta_info"]["output_token_logprobs"]
            == direct_last["meta_info"]["output_token_logprobs"]
        )
        assert last["meta_info"]["finish_reason"] == direct_last["meta_info"]["finish_reason"]
        assert {f["meta_info"]["weight_version"] for f in frames} == {"1"}
        # A batch: each prompt is SGLang's answer for its own adapter (or the base model).
        r = _post(router.url, {"input_ids": [IDS, IDS], "sampling_params": SP,
                               "lora_path": [name, None]})  # fmt: skip
        assert r.status_code == 200, r.text
        a, b = r.json()
        assert a["output_ids"] == _direct(engine, {**body, "stream": False})["output_ids"]
        assert b["output_ids"] == base["output_ids"]
        assert b["meta_info"]["weight_version"] == "default"
        # Names the router does not know are its own 404, before any engine sees them.
        r = _post(router.url, {"input_ids": IDS, "lora_path": "sgn-nosuch"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
    finally:
        _unload(engine, [f"{name}@v1"])


def _miles_abort(router_url: str) -> None:
    """What Miles and slime do at a step boundary: list the workers, abort all on each, and
    poll each one's load until it is idle."""
    workers = httpx.get(router_url + "/workers", timeout=10).json()["workers"]
    for w in workers:
        assert httpx.post(w["url"] + "/abort_request", json={"abort_all": True},
                          timeout=10).status_code == 200  # fmt: skip

    def idle() -> bool:
        return all(
            httpx.get(w["url"] + "/v1/loads?include=core", timeout=10).json()["num_reqs"] == 0
            for w in workers
        )

    wait_until(idle, timeout=60, message="workers idle after abort")


def test_a_miles_rollout_loop_while_publications_happen(
    sglang_server, launcher, tiny_model, tmp_path
):
    agent, router, token = _fleet(launcher, sglang_server, tmp_path)
    name, engine = "sgn-loop", sglang_server.url
    expected: dict[int, list[int]] = {}
    answers: list[dict] = []
    stop = threading.Event()
    errors: list[str] = []
    # Miles' rollout request (sglang_rollout.py): token ids, return_logprob, lora_path.
    long_sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    payload = {
        "input_ids": IDS,
        "return_logprob": True,
        "lora_path": name,
        "sampling_params": long_sp,
    }

    def rollouts() -> None:
        while not stop.is_set():
            try:
                r = _post(router.url, payload)
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                continue
            if r.status_code != 200:
                errors.append(r.text)
                continue
            answers.append(r.json())

    workers = [threading.Thread(target=rollouts) for _ in range(3)]
    try:
        with Publisher([agent.url], router=router.url, token=token) as pub:
            for step in (1, 2, 3):
                model = make_peft_model(tiny_model, r=8, seed=80 + step)
                state = get_peft_model_state_dict(model, adapter_name="default")
                config = model.peft_config["default"].to_dict()
                assert pub.publish(state, name=name, config=config).version == step
                full = {**payload, "lora_path": f"{name}@v{step}"}
                expected[step] = _direct(engine, full)["output_ids"]
                if step == 1:
                    for t in workers:
                        t.start()
                # Rollouts run on this version (one has come back from it, others are in
                # flight) when the step boundary aborts them: a wait, not a fixed sleep.
                wait_until(
                    lambda step=step: any(a["lorafleet"]["version"] == step for a in answers),
                    timeout=120,
                    message=f"a rollout answered by v{step}",
                )
                _miles_abort(router.url)
        after_abort = len(answers)
        wait_until(
            lambda: len(answers) > after_abort, timeout=120, message="rollouts go on after abort"
        )
    finally:
        stop.set()
        for t in workers:
            t.join(60)
        _unload(engine, [f"{name}@v{v}" for v in (1, 2, 3)])
    assert not errors, errors[:3]
    assert answers
    seen = set()
    for out in answers:
        meta = out["meta_info"]
        version = out["lorafleet"]["version"]
        seen.add(version)
        assert meta["weight_version"] == str(version)
        ids = [t for _, t, _ in meta["output_token_logprobs"]]
        assert ids == out["output_ids"]
        if meta["finish_reason"]["type"] == "abort":  # Miles' abort: a prefix of that version's
            assert out["output_ids"] == expected[version][: len(out["output_ids"])]
        else:
            assert out["output_ids"] == expected[version], version
    assert seen == {1, 2, 3}, seen


def test_the_miles_story_resume_from_base(launcher, tiny_model, tmp_path, sglang_server):
    """Engine from base; the first publish a native-only checkpoint (state dict + PEFT's config
    dict); the same name next step; the engine restarted from base with no publish (the agent
    reinstalls); then a resumed trainer's first publish."""
    agent, router, token = _fleet(launcher, sglang_server, tmp_path)
    engine, name = sglang_server.url, "miles_lora"
    body = {"input_ids": IDS, "sampling_params": SP, "return_logprob": True}
    models = {s: make_peft_model(tiny_model, r=8, seed=90 + s) for s in (1, 2)}

    def native(step: int) -> tuple[dict, dict]:
        state = get_peft_model_state_dict(models[step], adapter_name="default")
        return state, models[step].peft_config["default"].to_dict()

    def routed() -> dict:
        httpx.post(engine + "/flush_cache", timeout=30)  # the same prefill as _direct's
        r = _post(router.url, {**body, "lora_path": name})
        assert r.status_code == 200, r.text
        return r.json()

    assert _direct(engine, {**body, "lora_path": None})["meta_info"]["weight_version"]
    with Publisher([agent.url], router=router.url, token=token) as pub:
        state, config = native(1)
        assert pub.publish(state, name=name, config=config).version == 1
        v1 = _direct(engine, {**body, "lora_path": f"{name}@v1"})
        _same(routed(), v1, 1)
        state, config = native(2)
        assert pub.publish(state, name=name, config=config).version == 2
        v2 = _direct(engine, {**body, "lora_path": f"{name}@v2"})
        assert v2["output_ids"] != v1["output_ids"]
        _same(routed(), v2, 2)
    # The engine restarts from the base model; nobody publishes. The agent reinstalls v2.
    launcher.restart(sglang_server)

    def back() -> bool:
        r = _post(router.url, {**body, "lora_path": name})
        return r.status_code == 200 and r.json()["output_ids"] == v2["output_ids"]

    wait_until(back, timeout=300, message="v2 served again after the engine restart")
    _same(routed(), v2, 2)
    # A resumed trainer (a new Publisher) publishes what it restored: the next version.
    with Publisher([agent.url], router=router.url, token=token) as pub:
        state, config = native(2)
        assert pub.publish(state, name=name, config=config).version == 3
    out = routed()
    assert out["meta_info"]["weight_version"] == "3" and out["output_ids"] == v2["output_ids"]
    _unload(engine, [f"{name}@v{v}" for v in (1, 2, 3)])
