"""lorafleet: verified, versioned, atomic LoRA adapter publication to inference fleets.

The top-level names are what a trainer needs; everything else lives in its subpackage
(``lorafleet.publisher``, ``lorafleet.bundle``, ``lorafleet.errors``, ``lorafleet.fleet``...).
Importing lorafleet does not import torch.

The names load on first use (PEP 562, as huggingface_hub does): every agent, router and engine
process imports this package on its way to its own subpackage, and should not pay for the
publisher's and the bundle's imports at each start.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from lorafleet.bundle import AdapterBundle
    from lorafleet.errors import LorafleetError, PublishError
    from lorafleet.publisher import AsyncPublisher, Publisher, PublishResult, Timeouts

__version__ = "0.1.0"

_SOURCES = {
    "AdapterBundle": "lorafleet.bundle",
    "AsyncPublisher": "lorafleet.publisher",
    "LorafleetError": "lorafleet.errors",
    "PublishError": "lorafleet.errors",
    "PublishResult": "lorafleet.publisher",
    "Publisher": "lorafleet.publisher",
    "Timeouts": "lorafleet.publisher",
}

__all__ = [
    "AdapterBundle",
    "AsyncPublisher",
    "LorafleetError",
    "PublishError",
    "PublishResult",
    "Publisher",
    "Timeouts",
    "__version__",
]


def __getattr__(name: str) -> typing.Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'lorafleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
