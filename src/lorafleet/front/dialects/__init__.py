"""Trainer dialects: which server's API a front speaks, one module each.

A dialect is a tuple of route groups. A route group is a function ``(Front, control) ->
APIRouter``, where ``control`` is the FastAPI dependency that admits control calls (token, or the
opt-in tokenless allow-list). A group uses ``Front`` (lorafleet's logic, no HTTP) and
``lorafleet.front.forward`` for generation. Adding a dialect is one module here and one line in
``DIALECTS``; ``lorafleet front --dialect`` and ``FrontConfig.dialect`` take its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter
from fastapi.params import Depends

from lorafleet.front.dialects import sglang, skyrl, vllm
from lorafleet.front.service import Front

__all__ = ["DIALECTS", "Dialect", "RouteGroup"]

RouteGroup = Callable[[Front, Depends], APIRouter]


@dataclass(frozen=True)
class Dialect:
    """A server API a front can speak: ``summary`` for ``--help``, ``groups`` its routes."""

    name: str
    summary: str
    groups: tuple[RouteGroup, ...]


DIALECTS: dict[str, Dialect] = {
    d.name: d
    for d in (
        Dialect(
            "vllm", "one vLLM server's API (TRL, prime-rl, AReaL)", (vllm.routes, vllm.areal_routes)
        ),
        # SkyRL's group first: where both groups have a path, the first included wins.
        Dialect(
            "skyrl",
            "SkyRL's inference server (RemoteInferenceClient)",
            (skyrl.routes, vllm.routes),
        ),
        Dialect("sglang", "one SGLang server's API (AReaL)", (sglang.routes,)),
    )
}
