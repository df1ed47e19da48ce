"""The trainer-name rule, which lives in ``lorafleet.protocol.trainer_names`` (the router reads
it too); re-exported here, where the fronts always imported it from."""

from lorafleet.protocol.trainer_names import DEFAULT_PATTERN, NameMap, TrainerName

__all__ = ["DEFAULT_PATTERN", "NameMap", "TrainerName"]
