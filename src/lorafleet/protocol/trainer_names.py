"""Trainer adapter names <-> lorafleet names and versions. Pure functions, no I/O.

A trainer that loads ``trl-policy-v7`` publishes lorafleet name ``trl-policy`` version 7 (the
pattern is configurable); a name the pattern does not match (prime-rl reloads one name every
step) is the next version of that name. Generation addresses the router's pins: ``trl-policy-v7``
becomes ``trl-policy@v7``. Version 0 is the base model (AReaL's ``policy-v0`` names the weights
its servers started with): it is never loaded, and generation for it goes to the base model.

One rule for every place that reads a trainer's name: the fronts (a load, a ``model``) and the
router (SGLang's ``lora_path`` on native ``/generate``, with the default pattern).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DEFAULT_PATTERN", "NameMap", "TrainerName"]

DEFAULT_PATTERN = r"^(?P<name>.+)-v(?P<version>\d+)$"


@dataclass(frozen=True)
class TrainerName:
    """What a trainer's adapter name means: ``version`` None for an unversioned name."""

    name: str
    version: int | None


class NameMap:
    """Parse trainer names with ``pattern`` (named groups ``name`` and ``version``).

    Raises ``ValueError`` for a pattern without both groups or that does not compile.
    """

    def __init__(self, pattern: str = DEFAULT_PATTERN) -> None:
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"name pattern {pattern!r} does not compile: {exc}") from exc
        if not {"name", "version"} <= set(self.regex.groupindex):
            raise ValueError(f"name pattern {pattern!r} needs groups (?P<name>) and (?P<version>)")

    def parse(self, lora_name: str) -> TrainerName:
        m = self.regex.match(lora_name)
        if m is None or not m.group("name"):
            return TrainerName(lora_name, None)
        version = int(m.group("version"))
        if version < 1:
            return TrainerName(lora_name, None)
        return TrainerName(m.group("name"), version)

    def is_base(self, lora_name: object) -> bool:
        """Whether ``lora_name`` is version 0 of a name (``policy-v0``): the base model."""
        if not isinstance(lora_name, str):
            return False
        m = self.regex.match(lora_name)
        return m is not None and bool(m.group("name")) and int(m.group("version")) == 0

    @staticmethod
    def router_model(name: TrainerName) -> str:
        """The router's address for it: the pin ``name@vN``, or the plain name (the newest)."""
        return name.name if name.version is None else f"{name.name}@v{name.version}"
