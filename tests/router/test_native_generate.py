"""SGLang's native ``/generate``, ``/workers`` and ``/abort_request`` at the router, on real
reference engines behind real agents (translated: the engine answers a streamed completion).

Every routed answer must equal the engine's own answer for the same adapter version, put in
SGLang's shape by this file's own translation (from the engine's non-streamed completion), and
carry the version as ``meta_info.weight_version`` and in the ``lorafleet`` tag.
"""

from __future__ import annotations

import itertools
import json
import threading

import httpx
import pytest

from lorafleet.testing import wait_until
from tests.router.helpers import install_sync, set_alias, wait_healthy

pytestmark = pytest.mark.timeout(300)
IDS = [1, 45, 49, 173]
SP = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def routed(fleet, peft_dir, tmp_path_factory):
    """A router over the module's fleet with ``nat`` v1 on both replicas."""
    from lorafleet.launch import Launcher

    with Launcher(tmp_path_factory.mktemp("native-logs")) as launcher:
        router = fleet.start_router(launcher)
        wait_healthy(router, 2)
        ids = [r.replica_id for r in fleet.replicas]
        en = install_sync(fleet.agents, peft_dir, "nat", 1)
        assert set_alias(router, "nat", 1, en, ids).status_code == 200
        yield router


def gen(router, timeout=60.0, **body) -> httpx.Response:
    body.setdefault("sampling_params", SP)
    return httpx.post(router.url + "/generate", json=body, timeout=timeout)


def engine_answer(fleet, model: str, ids: list[int], top: int | None, **extra) -> dict:
    """The engine's own completion for ``model``, in SGLang's shape (this test's translation)."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": SP["max_new_tokens"],
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    if top is not None:
        body |= {"logprobs": top, "return_tokens_as_token_ids": True}
    r = httpx.post(fleet.engines[0].url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    out = {"text": c["text"], "output_ids": c["token_ids"]}
    if top is not None:
        lp = c["logprobs"]
        out["output_token_logprobs"] = [
            [v, int(t.removeprefix("token_id:")), None]
            for v, t in zip(lp["token_logprobs"], lp["tokens"], strict=True)
        ]
        if top:
            out["output_top_logprobs"] = [
                [
                    [v, int(t.removeprefix("token_id:")), None]
                    for t, v in sorted(d.items(), key=lambda x: -x[1])[:top]
                ]
                for d in lp["top_logprobs"]
            ]
    return out


def test_ids_with_logprobs_equal_the_engines_answer(routed, fleet):
    want = engine_answer(fleet, "nat@v1", IDS, 2)
    r = gen(
        routed, input_ids=IDS, return_logprob=True, top_logprobs_num=2, lora_path="nat", rid="r-1"
    )
    assert r.status_code == 200, r.text
    assert r.headers["X-Lorafleet-Adapter-Version"] == "1"
    out = r.json()
    meta = out["meta_info"]
    assert out["text"] == want["text"] and out["output_ids"] == want["output_ids"]
    assert meta["output_token_logprobs"] == want["output_token_logprobs"]
    assert meta["output_top_logprobs"] == want["output_top_logprobs"]
    assert meta["id"] == "r-1"
    assert meta["weight_version"] == "1" and out["lorafleet"]["version"] == 1
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (4, 6)
    assert meta["weight_versions"] == [{"version": "1", "start": 0, "end": 6}]


def test_prompt_logprobs_from_logprob_start_len(routed, fleet):
    echo = {
        "model": "nat@v1", "prompt": IDS, "max_tokens": 1, "temperature": 0, "echo": True,
        "logprobs": 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    lp = httpx.post(fleet.engines[0].url + "/v1/completions", json=echo, timeout=60).json()
    lp = lp["choices"][0]["logprobs"]
    scored = [
        [v, int(t.removeprefix("token_id:")), None]
        for v, t in zip(lp["token_logprobs"], lp["tokens"], strict=True)
    ]
    for start in (0, 2):
        r = gen(
            routed, input_ids=IDS, return_logprob=True, logprob_start_len=start, lora_path="nat"
        )
        assert r.status_code == 200, r.text
        got = r.json()["meta_info"]["input_token_logprobs"]
        want = [list(x) for x in scored[start : len(IDS)]]
        want[0][0] = None  # SGLang lists the first position of the range without a logprob
        assert got == want, (start, got, want)


def test_stream_is_cumulative_and_ends_with_the_whole_answer(routed, fleet):
    want = engine_answer(fleet, "nat@v1", IDS, 0)
    body = {"input_ids": IDS, "sampling_params": SP, "return_logprob": True, "stream": True,
            "lora_path": "nat@v1"}  # fmt: skip
    with httpx.stream("POST", routed.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    frames = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    ids = [f["output_ids"] for f in frames]
    assert all(b[: len(a)] == a for a, b in itertools.pairwise(ids))
    last = frames[-1]
    assert last["output_ids"] == want["output_ids"] and last["text"] == want["text"]
    assert last["meta_info"]["output_token_logprobs"] == want["output_token_logprobs"]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert all(f["meta_info"]["finish_reason"] is None for f in frames[:-1])
    assert {f["meta_info"]["weight_version"] for f in frames} == {"1"}


def test_lora_path_names_and_base(routed, fleet):
    want = engine_answer(fleet, "nat@v1", IDS, None)["output_ids"]
    base = engine_answer(fleet, "tiny", IDS, None)["output_ids"]
    assert want != base
    for name in ("nat", "nat@v1", "nat-v1"):
        r = gen(routed, input_ids=IDS, lora_path=name)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["output_ids"] == want, name
        assert r.json()["meta_info"]["weight_version"] == "1"
    r = gen(routed, input_ids=IDS)
    assert r.status_code == 200 and r.json()["output_ids"] == base
    assert r.json()["meta_info"]["weight_version"] == "default"
    assert r.json()["lorafleet"]["version"] is None
    r = gen(routed, input_ids=IDS, lora_path="nat@v9")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
    r = gen(routed, input_ids=IDS, lora_path="nosuch")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
    r = gen(routed, input_ids=IDS, lora_path="bad/name")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_name"


def test_a_replica_whose_engine_lacks_the_version_is_skipped(routed, fleet, peft_dir):
    """The table lists b for ``natlack`` v1, but only a's engine holds it (as after b's engine
    restarted empty): plain and streamed native requests are all served by a."""
    a, b = fleet.replicas
    en = install_sync([a.agent], peft_dir, "natlack", 1)
    assert set_alias(routed, "natlack", 1, en, [a.replica_id, b.replica_id]).status_code == 200
    for _ in range(4):
        r = gen(routed, input_ids=IDS, lora_path="natlack")
        assert r.status_code == 200, r.text
        assert r.json()["lorafleet"]["replica"] == a.replica_id
        body = {"input_ids": IDS, "sampling_params": SP, "stream": True, "lora_path": "natlack"}
        with httpx.stream("POST", routed.url + "/generate", json=body, timeout=60) as s:
            assert s.status_code == 200, s.read()
            assert s.headers["x-lorafleet-replica"] == a.replica_id
            assert s.read().decode().endswith("data: [DONE]\n\n")
    wait_healthy(routed, 2)  # b is back once its agent says ready


def test_batch_text_mixed_adapters_in_order(routed, fleet):
    r = gen(routed, text=["hello", "hello"], lora_path=["nat", None], rid="b")
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert [a["meta_info"]["id"], b["meta_info"]["id"]] == ["b_0", "b_1"]
    assert (a["meta_info"]["weight_version"], b["meta_info"]["weight_version"]) == ("1", "default")
    single = gen(routed, text="hello", lora_path="nat").json()
    assert a["output_ids"] == single["output_ids"] and a["text"] == single["text"]
    assert b["output_ids"] != a["output_ids"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": SP}, None),
        ({"input_ids": IDS, "sampling_params": {"min_p": 0.5}}, "sampling_params.min_p"),
        ({"input_ids": IDS, "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"input_ids": IDS, "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ({"input_ids": IDS, "input_embeds": [[0.0]]}, "input_embeds"),
        ({"input_ids": IDS, "return_routed_experts": True}, "return_routed_experts"),
        ({"input_ids": [IDS, IDS], "stream": True}, "stream"),
        ({"input_ids": [IDS, IDS], "lora_path": ["nat"]}, None),
        ({"input_ids": []}, None),
        ({"input_ids": IDS, "image_data": ["x.png"]}, "image_data"),
    ],
)
def test_what_a_translated_path_cannot_honour_is_a_400(routed, body, param):
    r = httpx.post(routed.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    if "input_ids" not in body:
        assert err["message"] == "Either text, input_ids or input_embeds should be provided."


def test_empty_image_data_and_areal_sampling_params_are_accepted(routed):
    sp = {"top_p": 1.0, "top_k": -1, "max_new_tokens": 4, "temperature": 0,
          "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
          "frequency_penalty": 0.0}  # fmt: skip
    r = gen(routed, input_ids=IDS, image_data=[], sampling_params=sp, return_logprob=True,
            stream=False, lora_path="nat-v1")  # fmt: skip
    assert r.status_code == 200, r.text
    assert len(r.json()["meta_info"]["output_token_logprobs"]) == 4


def test_top_k_and_the_prompts_top_logprobs_are_translated(routed, fleet):
    """The reference engine honours top_k and scores the prompt's top tokens: SGLang's
    /generate asks them of it rather than refusing them."""
    greedy = gen(routed, input_ids=IDS, lora_path="nat").json()["output_ids"]
    sp = {**SP, "temperature": 1.0, "top_k": 1, "sampling_seed": 3}
    r = gen(routed, input_ids=IDS, lora_path="nat", sampling_params=sp)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == greedy
    r = gen(routed, input_ids=IDS, lora_path="nat", return_logprob=True, logprob_start_len=0,
            top_logprobs_num=2)  # fmt: skip
    assert r.status_code == 200, r.text
    tops = r.json()["meta_info"]["input_top_logprobs"]
    assert len(tops) == len(IDS) and all(len(t) == 2 for t in tops[1:])


def test_openai_n_and_prompt_logprobs_pass_through_the_data_plane(routed):
    body = {"model": "nat", "prompt": IDS, "max_tokens": 2, "temperature": 1.0, "seed": 5,
            "n": 3, "prompt_logprobs": 1}  # fmt: skip
    r = httpx.post(routed.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 3 and out["lorafleet"]["version"] == 1
    assert all(len(c["prompt_logprobs"]) == len(IDS) for c in out["choices"])


def test_skyrl_shape_still_answers_choices(routed):
    body = {
        "model": "nat",
        "token_ids": IDS,
        "sampling_params": {"max_tokens": 3, "temperature": 0},
    }
    r = httpx.post(routed.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 3


def test_workers_and_abort_end_translated_requests_with_partial_output(routed, fleet):
    listed = httpx.get(routed.url + "/workers", timeout=10).json()
    assert listed["total"] == 2
    urls = [w["url"] for w in listed["workers"]]
    assert all(u.startswith(routed.url + "/workers/") for u in urls)
    assert httpx.get(routed.url + "/list_workers", timeout=10).json() == {"urls": urls}
    got: dict = {}
    long_sp = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}

    def run(key: str, rid: str) -> None:
        got[key] = gen(routed, timeout=120, input_ids=IDS, rid=rid, lora_path="nat",
                       return_logprob=True, sampling_params=long_sp)  # fmt: skip

    threads = [threading.Thread(target=run, args=(k, f"long-{k}")) for k in ("a", "b")]
    for t in threads:
        t.start()
    # Both in flight before the aborts (polled: a quiet machine finishes 400 tokens in ~1 s).
    wait_until(
        lambda: sum(httpx.get(u + "/v1/loads", timeout=10).json()["num_reqs"] for u in urls) == 2,
        message="both long requests in flight on the workers",
    )
    # One by rid at the router, the other by abort_all on each worker, as Miles does.
    assert (
        httpx.post(routed.url + "/abort_request", json={"rid": "long-a"}, timeout=10).status_code
        == 200
    )
    threads[0].join(30)
    assert not threads[0].is_alive()
    assert threads[1].is_alive()
    for u in urls:
        assert (
            httpx.post(u + "/abort_request", json={"abort_all": True}, timeout=10).status_code
            == 200
        )
    threads[1].join(30)
    for k in ("a", "b"):
        r = got[k]
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
        assert 0 < len(out["output_ids"]) < 400
        assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
        assert meta["weight_version"] == "1"
    assert [httpx.get(u + "/v1/loads", timeout=10).json()["num_reqs"] for u in urls] == [0, 0]
    r = httpx.post(routed.url + "/workers/nosuch/abort_request", json={}, timeout=10)
    assert r.status_code == 404
