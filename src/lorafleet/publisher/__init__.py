"""The trainer-side Publisher: atomic, versioned publication to every replica."""

from lorafleet.publisher.publisher import AsyncPublisher, ProgressCallback, Publisher
from lorafleet.publisher.result import (
    PublishResult,
    ReplicaState,
    ReplicaTiming,
    Retirement,
    Timeouts,
)

__all__ = [
    "AsyncPublisher",
    "ProgressCallback",
    "PublishResult",
    "Publisher",
    "ReplicaState",
    "ReplicaTiming",
    "Retirement",
    "Timeouts",
]
