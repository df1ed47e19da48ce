"""schemathesis against the reference engine's OpenAPI document: open (as a fleet runs it) over
loopback, and with vLLM's ``--api-key`` in process, with and without the key."""

from __future__ import annotations

import pytest

from tests.fuzz.conftest import ENGINE_KEY
from tests.fuzz.helpers import from_asgi, from_url, fuzz


def test_open_engine_answers_inside_its_document(targets):
    schema = from_url(targets.engine_url + "/openapi.json")
    found = fuzz(schema, max_examples=6)
    assert not found, "\n\n".join(found)


@pytest.mark.parametrize("key", [True, False], ids=["key", "no-key"])
def test_keyed_engine_answers_inside_its_document(targets, key):
    schema = from_asgi(targets.keyed_engine)
    tokens = {"apiKey": ENGINE_KEY} if key else None
    found = fuzz(schema, tokens=tokens, max_examples=3)
    assert not found, "\n\n".join(found)
