"""schemathesis against the agent's OpenAPI document, with and without the control token.

The agent is a real process in front of a real reference engine: every route answers from the
real store and engine, through uvicorn's own parsing of hostile paths and headers.
"""

from __future__ import annotations

import pytest

from tests.fuzz.conftest import TOKEN
from tests.fuzz.helpers import from_url, fuzz


@pytest.mark.parametrize("token", [True, False], ids=["token", "no-token"])
def test_agent_answers_inside_its_document(targets, token):
    schema = from_url(targets.agent.url + "/openapi.json")
    tokens = {"controlToken": TOKEN} if token else None
    found = fuzz(schema, tokens=tokens, max_examples=6 if token else 3)
    assert not found, "\n\n".join(found)
