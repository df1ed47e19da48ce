"""Run schemathesis over every operation of one OpenAPI schema and collect what it finds.

Each operation gets its own Hypothesis run, positive data (what the schema allows) then negative
data (what it refuses), seeded and bounded by ``max_examples``; the checks are the ones the issue
names. Findings are gathered across operations instead of stopping at the first, so one run
shows every route that answers outside its document.

The suite's run is small and the same every time (derandomized). For a deeper hunt:
``LORAFLEET_FUZZ_SCALE=20`` multiplies every ``max_examples``, and ``LORAFLEET_FUZZ_SEED=<int>``
draws other examples than the suite's.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
# Not a server error: 2xx-4xx, and 507, the agent's quota_exceeded, its documented answer to a
# manifest declaring more bytes than its disk has free (the fuzzer declares 128 GiB files).
# Every other 5xx is one.
NOT_SERVER_ERRORS = ["2xx", "3xx", "4xx", "507"]
CONFIG = schemathesis.Config.from_dict(
    {"checks": {"not_a_server_error": {"expected-statuses": NOT_SERVER_ERRORS}}}
)
SCALE = int(os.environ.get("LORAFLEET_FUZZ_SCALE", "1"))
SEED = os.environ.get("LORAFLEET_FUZZ_SEED")


def from_url(url: str) -> schemathesis.BaseSchema:
    """The OpenAPI document a server on loopback serves at ``url``."""
    return schemathesis.openapi.from_url(url, config=CONFIG)


def from_asgi(app: Any) -> schemathesis.BaseSchema:
    """The OpenAPI document of an ASGI app, driven in process."""
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)


def fuzz(
    schema: schemathesis.BaseSchema,
    *,
    tokens: dict[str, str] | None = None,
    max_examples: int = 10,
) -> list[str]:
    """Fuzz every operation of ``schema``, each with positive then negative data.

    ``tokens``: the bearer token for each security scheme the document declares (an operation
    gets the one its ``security`` names); None sends none (what schemathesis generates for the
    scheme, if anything, goes instead). Returns one line per operation and mode that failed a
    check: empty means the service answered every input inside its document, with no 5xx.
    """
    found: list[str] = []
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in MODES:
            ran += 1
            started = time.monotonic()
            finding = _fuzz_one(op, mode, _auth(op, tokens), max_examples * SCALE)
            print(f"{op.label} [{mode.value}]: {time.monotonic() - started:.2f}s")
            if finding is not None:
                found.append(f"{op.label} [{mode.value}]: {finding}")
    assert ran, "the schema has no operations"
    return found


def _fuzz_one(
    op: schemathesis.APIOperation,
    mode: GenerationMode,
    headers: dict[str, str] | None,
    max_examples: int,
) -> str | None:
    """One Hypothesis run over ``op``: None, or the first finding and how to reproduce it."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=SEED is None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=headers, checks=CHECKS, timeout=30)

    if SEED is not None:
        run = seed(int(SEED))(run)
    try:
        run()
    except Unsatisfiable:  # nothing to make invalid: no parameters, no body
        assert mode is GenerationMode.NEGATIVE, op.label
    except Exception as exc:  # the checks' failures, with schemathesis's curl line
        return "".join(traceback.format_exception_only(exc)).strip()
    return None


def _auth(op: schemathesis.APIOperation, tokens: dict[str, str] | None) -> dict[str, str] | None:
    if tokens is None:
        return None
    for requirement in op.definition.raw.get("security", []):
        for scheme in requirement:
            if scheme in tokens:
                return {"Authorization": f"Bearer {tokens[scheme]}"}
    return None
