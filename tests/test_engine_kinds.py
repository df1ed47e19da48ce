"""The engine-kind registry is the one place a kind is declared (lorafleet.engine_kinds)."""

from __future__ import annotations

import typing

import pytest
from click.testing import CliRunner

from lorafleet.agent.backends import EngineBackend, make_backend
from lorafleet.agent.cli import command as agent_command
from lorafleet.engine_kinds import ENGINE_KINDS, EngineKind, _kinds, engine_kind
from lorafleet.launch.specs import ServerSpec
from lorafleet.rules import rulebook


def test_the_literal_and_the_registry_name_the_same_kinds():
    assert tuple(_kinds()) == typing.get_args(EngineKind) == ENGINE_KINDS


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_every_kind_brings_a_backend_a_rulebook_and_a_launch_spec(kind):
    info = engine_kind(kind)
    backend = make_backend(kind, "http://127.0.0.1:9", max_lora_rank=8, max_adapters=2)
    assert isinstance(backend, EngineBackend) and backend.kind == kind
    assert rulebook(kind) is info.rulebook() and info.rulebook().kind == kind
    assert issubclass(info.spec_class(), ServerSpec)


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        engine_kind("tgi")
    with pytest.raises(ValueError, match="unknown engine kind"):
        make_backend("tgi", "http://127.0.0.1:9")


def test_an_engine_option_belongs_to_its_kind():
    backend = make_backend("sglang", "http://127.0.0.1:9", options={"sglang_upsert": True})
    assert backend.upsert is True
    assert make_backend("sglang", "http://127.0.0.1:9").upsert is False
    out = CliRunner().invoke(
        agent_command,
        ["--engine", "vllm", "--engine-url", "http://127.0.0.1:9", "--data-dir", "/nonexistent/x",
         "--sglang-upsert"],
    )  # fmt: skip
    assert out.exit_code == 2 and "--sglang-upsert is a sglang option" in out.output
