"""A misconfigured engine: real SGLang 0.5.23's behaviour with vLLM's load routes kept.

``lorafleet engine --dialect sglang`` plus vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``: it loads like vLLM and addresses like SGLang, so an agent told
``--engine vllm`` can load into it while a bare adapter name serves the base model. Only the
tests run it (``start_misaddressed_engine``): ``python -m tests.doubles.misaddressed_engine
<engine args>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet.engine import _vllm_admin
from lorafleet.engine import app as engine_app
from lorafleet.engine import cli as engine_cli
from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.launch import Launcher, Server
from tests.doubles import module_argv, spawn_env

__all__ = ["MisaddressedEngineSpec", "start_misaddressed_engine"]


def _create_app(runtime, **options):
    app = _real_create_app(runtime, **options)
    app.include_router(_vllm_admin.router(runtime, app.state.metrics))
    return app


_real_create_app = engine_app.create_app


@dataclass(frozen=True, kw_only=True)
class MisaddressedEngineSpec(ReferenceEngineSpec):
    """``ReferenceEngineSpec`` in SGLang's dialect, run as this module."""

    dialect: str = "sglang"
    name: str = "engine-misaddressed"

    def argv(self, fd: int) -> list[str]:
        return module_argv(__name__, super().argv(fd), "engine")

    def environ(self) -> dict[str, str]:
        return {**super().environ(), **spawn_env()}


def start_misaddressed_engine(
    launcher: Launcher, model: Path, *, max_lora_rank: int = 64
) -> Server[MisaddressedEngineSpec]:
    """The misconfigured engine on ``model`` served as "tiny", ready on /health."""
    return launcher.start(MisaddressedEngineSpec(model=Path(model), max_lora_rank=max_lora_rank))


if __name__ == "__main__":
    # The real engine, with vLLM's routes added: the runtime has no option for it.
    engine_app.create_app = _create_app
    engine_cli.command()
