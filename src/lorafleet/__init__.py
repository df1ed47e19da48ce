"""lorafleet: verified, versioned, atomic LoRA adapter publication to inference fleets.

The top-level names are what a trainer needs; everything else lives in its subpackage
(``lorafleet.publisher``, ``lorafleet.bundle``, ``lorafleet.errors``, ``lorafleet.fleet``...).
Importing lorafleet does not import torch.
"""

from lorafleet.bundle import AdapterBundle
from lorafleet.errors import LorafleetError, PublishError
from lorafleet.publisher import AsyncPublisher, Publisher, PublishResult, Timeouts

__version__ = "0.1.0"

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
