"""Generation shapes: each route the data plane answers is one small module here.

A shape (``base.Shape``) declares its path, the body model that documents and validates it,
whether it streams, and how a request maps to each engine kind and back. The pipeline does what
every shape shares. The hot paths, the dispatch and the OpenAPI document are derived from
``SHAPES``: adding a shape is a module with a ``Shape`` subclass and one line here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorafleet.dataplane.shapes.base import Shape
from lorafleet.dataplane.shapes.openai import ChatCompletions, Completions
from lorafleet.dataplane.shapes.sglang import SGLangGenerate
from lorafleet.dataplane.shapes.token_generate import TokenGenerate
from lorafleet.dataplane.shapes.vllm_generate import InferenceGenerate
from lorafleet.errors import InvalidRequest

__all__ = ["HOT_PATHS", "SHAPES", "Dispatch"]

SHAPES: tuple[Shape, ...] = (
    Completions(),
    ChatCompletions(),
    # Two shapes share /generate, told apart by the body: SGLang's first.
    SGLangGenerate(),
    TokenGenerate(),
    InferenceGenerate(),
)
HOT_PATHS = frozenset(s.path for s in SHAPES)
"""The POST routes the data plane answers itself, outside FastAPI."""


class Dispatch:
    """Which shape answers a request: by path, then by body where paths are shared."""

    def __init__(self, shapes: Sequence[Shape]) -> None:
        self.by_path: dict[str, list[Shape]] = {}
        for s in shapes:
            self.by_path.setdefault(s.path, []).append(s)

    @property
    def paths(self) -> frozenset[str]:
        return frozenset(self.by_path)

    def shape(self, path: str, doc: dict[str, Any]) -> Shape:
        """The shape for ``doc`` on ``path``. Raises ``InvalidRequest`` when none takes it."""
        for s in self.by_path.get(path, ()):
            if s.accepts(doc):
                return s
        raise InvalidRequest(f"no generation shape of {path} takes this body")
