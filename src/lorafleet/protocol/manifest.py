"""The manifest: what a bundle declares about itself. Pure values, no I/O.

Both the trainer and the agent use these types. A ``FileEntry`` validates its path when it is
built, so no manifest, however it was made, can name a file outside the adapter directory.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lorafleet.errors import FileNotAllowed, PathError, PathEscape
from lorafleet.protocol.names import AdapterName, Version, check_name

__all__ = [
    "ADAPTER_CONFIG",
    "ALLOWED_FILES",
    "WEIGHT_FILES",
    "FileEntry",
    "Manifest",
    "PathError",
    "check_file_path",
    "check_name",
]

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The only files a bundle may carry: what vLLM and SGLang read from an adapter directory.
ALLOWED_FILES = frozenset({ADAPTER_CONFIG, *WEIGHT_FILES})

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def check_file_path(path: str) -> str:
    """Return ``path`` if it is a safe, allow-listed bundle file name.

    Raises ``PathEscape`` (absolute, ``..``, a forbidden character) or ``FileNotAllowed``.
    """
    if not isinstance(path, str) or not path:
        raise FileNotAllowed("empty file name", path=str(path))
    if "\x00" in path or "\\" in path:
        raise PathEscape(f"file path {path!r} contains a forbidden character", path=path)
    if path.startswith("/") or posixpath.isabs(path):
        raise PathEscape(f"file path {path!r} is absolute", path=path)
    parts = path.split("/")
    if any(p in ("..", ".", "") for p in parts) or posixpath.normpath(path) != path:
        raise PathEscape(f"file path {path!r} escapes the adapter directory", path=path)
    if path not in ALLOWED_FILES:
        allowed = ", ".join(sorted(ALLOWED_FILES))
        raise FileNotAllowed(f"file {path!r} is not allowed (allowed: {allowed})", path=path)
    return path


class FileEntry(BaseModel):
    """One file of a bundle: its relative path, size in bytes and sha256 (lowercase hex)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The schema documents the allow-list and the digest's shape; the validators below enforce
    # them with their precise codes (file_not_allowed, path_escape).
    path: str = Field(json_schema_extra={"enum": sorted(ALLOWED_FILES)})
    size: int = Field(ge=0)
    sha256: str = Field(json_schema_extra={"pattern": f"^{_SHA256_RE.pattern}$"})

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        # Checked when built, wherever it is built: a hand-made manifest cannot name a file
        # outside the adapter directory or the allow-list (huggingface_hub's commit operations
        # validate the same way).
        return check_file_path(v)

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _SHA256_RE.fullmatch(v):
            raise ValueError("sha256 must be 64 lowercase hex characters")
        return v


class Manifest(BaseModel):
    """A named, versioned adapter: its files, PEFT config and base model. Immutable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: AdapterName
    """``lorafleet.protocol.names``'s rule (``check_name``, re-exported here)."""
    version: Version
    base_model: str | None = None
    config: dict[str, Any]
    files: tuple[FileEntry, ...]

    @field_validator("files")
    @classmethod
    def _unique(cls, v: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
        paths = [f.path for f in v]
        if len(set(paths)) != len(paths):
            raise ValueError("duplicate file paths in manifest")
        if not v:
            raise ValueError("a manifest needs at least one file")
        return v

    def canonical_json(self) -> bytes:
        """The canonical encoding the digest is computed over (sorted keys, no spaces)."""
        body = self.model_dump(mode="json")
        body["files"] = sorted(body["files"], key=lambda f: f["path"])
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """sha256 of the canonical manifest JSON: the bundle's identity."""
        return hashlib.sha256(self.canonical_json()).hexdigest()

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)
