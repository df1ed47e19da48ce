"""schemathesis against the router's OpenAPI document (control plane and data plane), with the
control token and the API key, and with neither.

The router is a real process over one real agent (replica ``r0``): requests for the base model
(no ``model``) reach the real reference engine, whose refusals the router relays.
"""

from __future__ import annotations

import pytest

from tests.fuzz.conftest import API_KEY, TOKEN
from tests.fuzz.helpers import from_url, fuzz


@pytest.mark.parametrize("token", [True, False], ids=["token", "no-token"])
def test_router_answers_inside_its_document(targets, token):
    schema = from_url(targets.router.url + "/openapi.json")
    tokens = {"controlToken": TOKEN, "apiKey": API_KEY} if token else None
    found = fuzz(schema, tokens=tokens, max_examples=8 if token else 3)
    assert not found, "\n\n".join(found)
