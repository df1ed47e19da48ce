"""``lorafleet engine``: serve a model on CPU with runtime LoRA, speaking vLLM's (and SGLang's) API,
or (``--dialect sglang``) only SGLang's, as a real SGLang 0.5.23 server does.

torch, transformers and peft are imported inside the command, so ``lorafleet`` itself imports
without them.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from lorafleet.launch.listen import api_key_option, listen_options

__all__ = ["command"]


def _threads() -> int:
    # The tiny model's matmuls are too small to gain from many threads, and the engine shares the
    # machine with its clients; two threads at most unless told otherwise.
    env = os.environ.get("LORAFLEET_ENGINE_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(2, (os.cpu_count() or 1) // 2 or 1))


@click.command("engine")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Directory of a transformers causal LM (with tokenizer).",
)
@click.option("--served-model-name", default=None, help="Model id clients use (default: dir name).")
@listen_options(8000)
@click.option("--max-loras", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--max-lora-rank", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--max-model-len", default=None, type=click.IntRange(min=1))
@click.option(
    "--max-logprobs",
    default=20,
    show_default=True,
    type=click.IntRange(min=-1),
    help="Most logprobs per token a request may ask, as vLLM's (-1: the vocabulary).",
)
@api_key_option(
    "Bearer token required on /v1/* and SGLang routes.", envvar="LORAFLEET_ENGINE_API_KEY"
)
@click.option(
    "--dialect",
    type=click.Choice(["vllm", "sglang"]),
    default="vllm",
    show_default=True,
    help="vllm: vLLM's API, with SGLang's routes beside it. sglang: behave as a real SGLang "
    "0.5.23 server (a bare adapter name in `model` serves the base model; no vLLM routes).",
)
@click.option(
    "--sglang-upsert",
    is_flag=True,
    help="With --dialect sglang: honour `upsert` on /load_lora_adapter, as the Miles fork does.",
)
@click.option("--log-level", default="warning", show_default=True)
def command(
    model_dir: str,
    served_model_name: str | None,
    host: str,
    port: int,
    fd: int | None,
    max_loras: int,
    max_lora_rank: int,
    max_model_len: int | None,
    max_logprobs: int,
    api_key: str | None,
    dialect: str,
    sglang_upsert: bool,
    log_level: str,
) -> None:
    """Run the reference engine: a CPU inference server with runtime LoRA (torch + PEFT)."""
    import torch
    from transformers.utils import logging as hf_logging

    from lorafleet.engine._runtime import Runtime
    from lorafleet.engine.app import create_app
    from lorafleet.launch.listen import serve
    from lorafleet.rules import REFERENCE, SGLANG

    hf_logging.disable_progress_bar()  # a progress bar per start only clutters the server log
    torch.set_num_threads(_threads())
    runtime = Runtime(
        model_dir,
        served_model_name=served_model_name or Path(model_dir).resolve().name,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_model_len=max_model_len,
        max_logprobs=max_logprobs,
        rules=SGLANG if dialect == "sglang" else REFERENCE,
    )
    app = create_app(
        runtime,
        api_key=api_key,
        dialect=dialect,
        sglang_upsert=sglang_upsert,
    )
    try:
        serve(app, host=host, port=port, fd=fd, log_level=log_level, access_log=False)
    finally:
        runtime.close()
