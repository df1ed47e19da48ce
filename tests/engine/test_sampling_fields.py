"""``n``, ``seed``, ``top_k`` and ``prompt_logprobs`` on ``/v1/completions``: one contract for the
reference engine and real vLLM (marked ``vllm``). GRPO asks for several samples per prompt and
Tinker-style clients for the prompt's log-probabilities; an engine that cannot honour a field
refuses it by name (400), never answers as if it had not been sent."""

from __future__ import annotations

import pytest

from tests.engine.test_engine_contract import PROMPT, complete, error_of, sse

MAX = 6


def test_n_answers_n_choices_indexed_per_prompt(engine):
    prompts = [PROMPT, PROMPT + " again"]
    # top_k 1 samples the greedy answer: the n samples of one prompt are the same answer, so
    # choice i * n + j is seen to be prompt i's.
    kw = {"temperature": 1.0, "top_k": 1, "seed": 3}
    out = complete(engine, prompt=prompts, n=3, max_tokens=MAX, return_token_ids=True, **kw)
    choices = out["choices"]
    assert sorted(c["index"] for c in choices) == list(range(6))
    by_index = {c["index"]: c for c in choices}
    one = complete(engine, prompt=prompts, max_tokens=MAX)["choices"]
    for c in range(6):
        assert by_index[c]["text"] == one[c // 3]["text"]
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


def test_sampled_n_with_a_seed_is_reproducible(engine):
    kw = {"n": 4, "temperature": 1.0, "seed": 7, "max_tokens": MAX}
    a, b = complete(engine, **kw), complete(engine, **kw)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len(a["choices"]) == 4


def test_top_k_1_samples_the_greedy_answer(engine):
    greedy = complete(engine, max_tokens=MAX)["choices"][0]["text"]
    for seed in (1, 2, 3):
        out = complete(engine, temperature=1.0, top_k=1, seed=seed, max_tokens=MAX)
        assert out["choices"][0]["text"] == greedy


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_score_every_prompt_token(engine, k):
    out = complete(engine, max_tokens=1, prompt_logprobs=k, return_token_ids=True)
    choice = out["choices"][0]
    ids, scored = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for tid, position in zip(ids[1:], scored[1:], strict=True):
        own = position[str(tid)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        assert len(position) <= k + 1 and (k == 0 or len(position) >= k)
        ranked = [v for key, v in position.items() if key != str(tid)]
        assert all(v["logprob"] >= own["logprob"] or own["rank"] <= k for v in ranked)
    # The same numbers as the echoed prompt's logprobs: one scoring of the prompt.
    echo = complete(engine, max_tokens=1, echo=True, logprobs=0)["choices"][0]["logprobs"]
    echoed = echo["token_logprobs"][: len(ids)]
    assert echoed[0] is None
    for mine, theirs in zip(scored[1:], echoed[1:], strict=True):
        value = next(iter(mine.values()))["logprob"]
        assert abs(value - theirs) < 1e-4


def test_greedy_n_is_refused(engine):
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2}
    r = engine.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "n must be 1 when using greedy sampling" in r.json()["error"]["message"]


def test_prompt_logprobs_with_stream_are_accepted_and_not_streamed(engine):
    """vLLM takes prompt_logprobs with stream=True and lists them only when echoing."""
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 0}
    chunks = sse(engine.client, "/v1/completions", {**body, "stream": True, "temperature": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert not any(c["choices"][0].get("prompt_logprobs") for c in chunks if c["choices"])


@pytest.mark.parametrize(
    ("field", "value"), [("min_p", 0.5), ("frequency_penalty", 1.0), ("best_of", 3)]
)
def test_a_field_the_engine_does_not_do_is_refused_by_name(engine, field, value):
    body = {"model": engine.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    # Its default asks nothing: accepted everywhere.
    default = {"min_p": 0.0, "frequency_penalty": 0.0, "best_of": 1}[field]
    assert engine.client.post("/v1/completions", json={**body, field: default}).status_code == 200
    r = engine.client.post("/v1/completions", json={**body, field: value})
    if engine.kind == "reference":
        assert field in error_of(r, 400)
        assert r.json()["error"]["param"] == field
    elif field != "best_of":  # vLLM honours these
        assert r.status_code == 200, r.text
