"""schemathesis against the front's OpenAPI document: the SGLang dialect's routes and AReaL's
``/areal_*`` routes on the vLLM dialect, over the fuzz package's real agent and router.

Control calls come from loopback without a token (allow-listed), as AReaL sends them. Every
operation must answer inside its document with no 5xx; a fuzzed pause that is never continued
holds nothing here, since a generation body is refused before it reaches the gate.
"""

from __future__ import annotations

import pytest

from lorafleet.front.service import FrontConfig
from tests.front.conftest import FrontServers
from tests.fuzz.conftest import API_KEY, TOKEN
from tests.fuzz.helpers import from_url, fuzz

# What each dialect adds for AReaL; the vLLM dialect's older routes are TRL's and documented there.
NEW_ROUTES = {"sglang": None, "vllm": r"^/areal_"}


@pytest.mark.parametrize("dialect", sorted(NEW_ROUTES))
def test_front_answers_inside_its_document(targets, dialect, tmp_path):
    fronts = FrontServers()
    try:
        url = fronts.start(
            FrontConfig(
                agents=[targets.agent.url],
                router=targets.router.url,
                shared_dirs=[tmp_path],
                fleet_token=TOKEN,
                api_key=API_KEY,
                allow_unauthenticated_control=True,
                dialect=dialect,
            )
        )
        schema = from_url(url + "/openapi.json")
        if NEW_ROUTES[dialect] is not None:
            schema = schema.include(path_regex=NEW_ROUTES[dialect])
        found = fuzz(schema, max_examples=8)
        assert not found, "\n\n".join(found)
    finally:
        fronts.stop()
