"""Local fleets: ``LocalFleet`` (on ``lorafleet.launch``), the fleet file, ``fleet.json``, the demo.

Torch-free: the demo's trainer lives in ``lorafleet.fleet.skill`` and imports torch lazily.
"""

from lorafleet.fleet.config import FleetConfig, FleetConfigError, ReplicaConfig, load_fleet_config
from lorafleet.fleet.local import LocalFleet
from lorafleet.fleetfile import FleetInfo, FleetNotFound, ReplicaInfo, read_fleet_file

__all__ = [
    "FleetConfig",
    "FleetConfigError",
    "FleetInfo",
    "FleetNotFound",
    "LocalFleet",
    "ReplicaConfig",
    "ReplicaInfo",
    "load_fleet_config",
    "read_fleet_file",
]
