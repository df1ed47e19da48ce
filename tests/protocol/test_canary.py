"""``lorafleet.protocol.canary``: the rule, and the schema under arbitrary input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lorafleet.protocol.canary import MIN_SHIFT, RATIO, Canary, CanaryPrompt, judge


def _canary(trainer: list[float], base: list[float]) -> Canary:
    tokens = list(range(len(trainer)))
    return Canary(
        prompts=[CanaryPrompt(prompt_ids=[1, 2], tokens=tokens, trainer=trainer, base=base)]
    )


TRAINER = [-1.0, -2.0, -3.0]
BASE = [-2.0, -1.0, -4.0]  # the adapter moves each token by 1 nat


def test_an_engine_at_the_trainers_values_passes():
    v = judge(_canary(TRAINER, BASE), [{0: -1.01, 1: -2.0, 2: -2.99}], tolerance=0.05)
    assert v.outcome == "passed"
    assert v.max_vs_trainer == pytest.approx(0.01)
    assert v.mean_vs_base == pytest.approx((0.99 + 1.0 + 1.01) / 3)


def test_an_engine_at_the_bases_values_fails_with_figures():
    v = judge(_canary(TRAINER, BASE), [dict(enumerate(BASE))], tolerance=0.05)
    assert v.outcome == "failed"
    assert v.mean_vs_base == 0.0 and v.mean_vs_trainer == pytest.approx(1.0)
    assert "closer to the trainer" in v.detail and "against the trainer" in v.detail


def test_half_way_fails_the_relative_rule():
    half = {i: (t + b) / 2 for i, (t, b) in enumerate(zip(TRAINER, BASE, strict=True))}
    v = judge(_canary(TRAINER, BASE), [half], tolerance=10.0)
    assert v.outcome == "failed" and v.mean_vs_trainer > RATIO * v.mean_vs_base


def test_close_in_ratio_but_over_the_kinds_tolerance_fails():
    v = judge(_canary(TRAINER, BASE), [{0: -1.2, 1: -2.0, 2: -3.0}], tolerance=0.1)
    assert v.outcome == "failed" and "tolerance" in v.detail


def test_a_token_missing_from_the_engines_top_counts_its_least_difference():
    # Token 2 is not listed: its value is at most the lowest listed, -2.0.
    v = judge(_canary(TRAINER, BASE), [{0: -1.0, 1: -2.0}], tolerance=0.05)
    assert v.max_vs_trainer == 0.0 and v.outcome == "passed"  # -3.0 is below -2.0
    # Token 0 (trainer -1.0) is not listed while -1.5 is the lowest: at least 0.5 off.
    v = judge(_canary(TRAINER, BASE), [{1: -1.5, 2: -1.5}], tolerance=0.05)
    assert v.max_vs_trainer >= 0.5 and v.outcome == "failed"


def test_an_adapter_that_barely_moves_the_canary_is_uninformative():
    v = judge(_canary([-1.0], [-1.0 - MIN_SHIFT / 2]), [{0: -1.0}], tolerance=0.05)
    assert v.outcome == "uninformative"


@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt_ids": [], "tokens": [1], "trainer": [-1.0], "base": [-1.0]},
        {"prompt_ids": [1], "tokens": [1, 2], "trainer": [-1.0], "base": [-1.0]},
        {"prompt_ids": [-1], "tokens": [1], "trainer": [-1.0], "base": [-1.0]},
        {"prompt_ids": [1], "tokens": [1], "trainer": [0.5], "base": [-1.0]},
        {"prompt_ids": [1], "tokens": [1], "trainer": [float("nan")], "base": [-1.0]},
        {"prompt_ids": [1], "tokens": [1], "trainer": [-1.0], "base": [-1.0], "x": 1},
    ],
)
def test_malformed_prompts_are_refused(prompt):
    with pytest.raises(ValidationError):
        Canary.model_validate({"prompts": [prompt]})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_prompt = st.fixed_dictionaries(
    {
        "prompt_ids": st.lists(st.integers(-2, 10), max_size=5),
        "tokens": st.lists(st.integers(-2, 10), max_size=5),
        "trainer": st.lists(st.floats(-50, 1), max_size=5),
        "base": st.lists(st.floats(-50, 1), max_size=5),
    }
)


@settings(max_examples=300, deadline=None)
@given(body=st.one_of(_json, st.fixed_dictionaries({"prompts": st.lists(_prompt, max_size=3)})))
def test_any_body_validates_or_is_a_validation_error(body):
    try:
        canary = Canary.model_validate(body)
    except ValidationError:
        return
    # What validates can be judged against any non-empty engine answer.
    answers = [{t: -1.0 for t in p.tokens} for p in canary.prompts]
    v = judge(canary, answers, tolerance=0.1)
    assert v.outcome in ("passed", "failed", "uninformative")
    assert v.mean_vs_trainer >= 0 and v.mean_vs_base >= 0
