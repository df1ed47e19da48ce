"""A drop-in front for trainers that speak one vLLM server's API (TRL's AsyncGRPO, prime-rl).

``lorafleet front`` answers ``/v1/load_lora_adapter`` with a lorafleet publication to every
replica, ``/v1/completions`` through the router, and ``/server_info`` as one server would.
"""

from lorafleet.front.names import DEFAULT_PATTERN, NameMap, TrainerName
from lorafleet.front.service import Front, FrontConfig

__all__ = ["DEFAULT_PATTERN", "Front", "FrontConfig", "NameMap", "TrainerName"]
