"""Adapter bundles: manifests, building, hashing and validation."""

from lorafleet.bundle.bundle import AdapterBundle, normalize_lora_keys, peft_config_dict
from lorafleet.bundle.validate import (
    ValidationReport,
    check_adapter,
    config_rank,
    validate_adapter_dir,
)
from lorafleet.protocol.manifest import (
    ADAPTER_CONFIG,
    ALLOWED_FILES,
    FileEntry,
    Manifest,
    PathError,
    check_file_path,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ALLOWED_FILES",
    "AdapterBundle",
    "FileEntry",
    "Manifest",
    "PathError",
    "ValidationReport",
    "check_adapter",
    "check_file_path",
    "config_rank",
    "normalize_lora_keys",
    "peft_config_dict",
    "validate_adapter_dir",
]
