"""SGLang's ``/generate`` body as the router reads it (lorafleet.protocol.sglang)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lorafleet.protocol.generation import GenerateRequest, is_native_generate


@pytest.mark.parametrize(
    ("body", "native"),
    [
        ({"input_ids": [1]}, True),
        ({"text": "x"}, True),
        ({"sampling_params": {}}, True),
        ({"model": "m", "token_ids": [1]}, False),
        ({"model": "m"}, False),
        ({"token_ids": [1]}, False),
    ],
)
def test_which_shape(body, native):
    assert is_native_generate(body) is native


def test_a_batch_expands_per_item_fields_and_a_string_rid():
    req = GenerateRequest.model_validate(
        {
            "text": ["a", "b"],
            "rid": "r",
            "lora_path": ["p", None],
            "return_logprob": [True, False],
            "sampling_params": [{"max_new_tokens": 3}, {"temperature": 0}],
            "top_logprobs_num": 2,
        }
    )
    a, b = req.items()
    assert (a.rid, b.rid) == ("r_0", "r_1")
    assert (a.lora_path, b.lora_path) == ("p", None)
    assert (a.return_logprob, b.return_logprob) == (True, False)
    assert (a.sampling_params.max_new_tokens, b.sampling_params.temperature) == (3, 0)
    assert a.top_logprobs_num == b.top_logprobs_num == 2
    assert a.logprob_start_len == -1


def test_single_prompt_ids_win_over_text_and_get_a_rid():
    req = GenerateRequest.model_validate({"text": "x", "input_ids": [1, 2]})
    (item,) = req.items()
    assert (item.text, item.input_ids) == (None, [1, 2])
    assert len(item.rid) == 32
    assert req.batch_size is None


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, "cannot be empty"),
        ({"text": []}, "cannot be empty"),
        ({"input_ids": [[1], []]}, "cannot be empty"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid has 1 entries"),
        ({"text": "a", "rid": ["x"]}, "rid has 1 entries"),
        ({"text": ["a", "b"], "lora_path": ["x"]}, "lora_path has 1 entries"),
        ({"text": "a", "lora_path": ["x"]}, "one prompt"),
        ({"text": "a", "sampling_params": [{}]}, "one prompt"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "Extra inputs"),
        ({"text": "a", "top_logprobs_num": 10**6}, "top_logprobs_num"),
        ({"input_ids": [1, "a"]}, "valid integer"),
    ],
)
def test_refusals(body, words):
    with pytest.raises(ValidationError, match=words.replace("(", r"\(")):
        GenerateRequest.model_validate(body)
