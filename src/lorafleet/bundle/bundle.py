"""``AdapterBundle``: the unit that is published. Files, digests and config, hashed once.

A bundle is built from a PEFT directory, a PEFT model in memory, or a state dict plus a config
dict (a native-only checkpoint with no adapter_config.json, seed 004). In-memory bundles are
serialized to safetensors bytes and never touch the trainer's disk.
"""

from __future__ import annotations

import enum
import io
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lorafleet.bundle.hashing import sha256_bytes, sha256_file
from lorafleet.bundle.validate import (
    BIN,
    SAFETENSORS,
    ValidationReport,
    check_adapter,
    validate_adapter_dir,
)
from lorafleet.errors import ManifestInvalid
from lorafleet.protocol.manifest import ADAPTER_CONFIG, FileEntry, Manifest
from lorafleet.rules import EngineKind

__all__ = ["AdapterBundle", "normalize_lora_keys", "peft_config_dict"]

Source = Path | bytes

_ADAPTER_SEGMENT = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")


def normalize_lora_keys(keys_to_values: Mapping[str, Any]) -> dict[str, Any]:
    """Drop PEFT's adapter segment: ``...lora_A.default.weight`` → ``...lora_A.weight``."""
    return {_ADAPTER_SEGMENT.sub(r".\1.weight", k): v for k, v in keys_to_values.items()}


def peft_config_dict(peft_config: Any) -> dict[str, Any]:
    """A JSON-safe dict of what PEFT hands over: a ``peft.LoraConfig`` or its ``to_dict()``
    (sets → sorted lists, enums such as ``PeftType.LORA`` → their values, tuples → lists).

    Every bundle's config passes through here once, when the bundle is built, so the checks,
    the manifest and the adapter_config.json all see ``"LORA"``, never ``PeftType.LORA``.
    Raises ``ManifestInvalid`` for anything that is neither a mapping nor has ``to_dict()``.
    """
    if hasattr(peft_config, "to_dict") and not isinstance(peft_config, Mapping):
        raw = peft_config.to_dict()
    elif isinstance(peft_config, Mapping):
        raw = dict(peft_config)
    else:
        raise ManifestInvalid(
            f"config must be a PEFT config dict or a peft.LoraConfig, not "
            f"{type(peft_config).__name__}"
        )

    def clean(v: Any) -> Any:
        if isinstance(v, set | frozenset):
            return sorted(clean(x) for x in v)
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, enum.Enum):  # PeftType and TaskType are str enums
            return v.value
        return v

    return clean(raw)


def _config_bytes(config: Mapping[str, Any]) -> bytes:
    return json.dumps(dict(config), indent=2, sort_keys=True).encode()


@dataclass(frozen=True)
class AdapterBundle:
    """A named, versioned adapter ready to publish. Immutable; digests are computed once."""

    manifest: Manifest
    sources: Mapping[str, Source] = field(repr=False)
    tensor_shapes: Mapping[str, list[int]] | None = field(default=None, repr=False)
    source_dir: Path | None = None

    # -- identity -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def files(self) -> tuple[FileEntry, ...]:
        return self.manifest.files

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.config

    @property
    def base_model(self) -> str | None:
        return self.manifest.base_model

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def total_size(self) -> int:
        return self.manifest.total_size

    def with_version(self, version: int, name: str | None = None) -> AdapterBundle:
        """The same files under another version (and name); no byte is re-hashed."""
        data = self.manifest.model_dump()
        data["version"] = version
        if name is not None:
            data["name"] = name
        try:
            manifest = Manifest.model_validate(data)
        except ValueError as exc:
            raise ManifestInvalid(str(exc)) from exc
        return AdapterBundle(manifest, self.sources, self.tensor_shapes, self.source_dir)

    # -- bytes --------------------------------------------------------------------------------
    def source(self, path: str) -> Source:
        return self.sources[path]

    def open(self, path: str) -> BinaryIO:
        """A readable binary stream of one file (on disk, or in memory)."""
        src = self.sources[path]
        return open(src, "rb") if isinstance(src, Path) else io.BytesIO(src)

    def write_to(self, directory: str | os.PathLike) -> Path:
        """Write the files into ``directory`` (e.g. a shared filesystem path)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for entry in self.files:
            with self.open(entry.path) as src, open(out / entry.path, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        return out

    def validate(
        self, *, max_rank: int | None = None, engine: EngineKind | None = None
    ) -> ValidationReport:
        """Validate the config and tensors (see ``lorafleet.bundle.validate``).

        ``engine``: the engine kind whose rulebook applies; None: what every engine kind refuses.
        """
        weights = tuple(p for p in (SAFETENSORS, BIN) if p in self.sources)
        if self.tensor_shapes is not None:
            return check_adapter(
                self.config,
                self.tensor_shapes,
                max_rank=max_rank,
                weight_files=weights,
                engine=engine,
            )
        assert self.source_dir is not None
        return validate_adapter_dir(
            self.source_dir, config=self.config, max_rank=max_rank, engine=engine
        )

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def _build(
        cls,
        *,
        name: str,
        version: int,
        base_model: str | None,
        config: Mapping[str, Any],
        sources: dict[str, Source],
        digests: dict[str, tuple[str, int]],
        tensor_shapes: Mapping[str, list[int]] | None = None,
        source_dir: Path | None = None,
    ) -> AdapterBundle:
        # The PEFT config names the base model when the caller does not.
        base_model = base_model or config.get("base_model_name_or_path")
        entries = tuple(
            FileEntry(path=p, sha256=digests[p][0], size=digests[p][1]) for p in sorted(sources)
        )
        try:
            manifest = Manifest(
                name=name,
                version=version,
                base_model=base_model,
                config=dict(config),
                files=entries,
            )
        except ValueError as exc:
            raise ManifestInvalid(str(exc)) from exc
        return cls(manifest, sources, tensor_shapes, source_dir)

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike,
        *,
        name: str,
        version: int = 1,
        base_model: str | None = None,
        config: Mapping[str, Any] | Any | None = None,
    ) -> AdapterBundle:
        """A bundle of a PEFT directory. ``config`` makes a native-only directory publishable.

        Only allow-listed files are taken (PEFT's README.md is left out). When ``config`` is given
        it is authoritative and becomes the bundle's adapter_config.json.
        """
        d = Path(path)
        if not d.is_dir():
            raise ManifestInvalid(f"{d} is not a directory")
        sources: dict[str, Source] = {}
        digests: dict[str, tuple[str, int]] = {}
        for fname in (SAFETENSORS, BIN):
            if (d / fname).is_file():
                sources[fname] = d / fname
                digests[fname] = sha256_file(d / fname)
        if config is None:
            cfg_path = d / ADAPTER_CONFIG
            if not cfg_path.is_file():
                raise ManifestInvalid(
                    f"{d} has no {ADAPTER_CONFIG}; pass config=<dict> for a native-only checkpoint"
                )
            try:
                config = json.loads(cfg_path.read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                raise ManifestInvalid(f"{cfg_path} is not valid JSON: {exc}") from exc
            if not isinstance(config, dict):
                raise ManifestInvalid(f"{cfg_path} must hold a JSON object")
            sources[ADAPTER_CONFIG] = cfg_path
            digests[ADAPTER_CONFIG] = sha256_file(cfg_path)
        else:
            config = peft_config_dict(config)
            blob = _config_bytes(config)
            sources[ADAPTER_CONFIG] = blob
            digests[ADAPTER_CONFIG] = (sha256_bytes(blob), len(blob))
        return cls._build(
            name=name,
            version=version,
            base_model=base_model,
            config=config,
            sources=sources,
            digests=digests,
            source_dir=d,
        )

    @classmethod
    def from_state_dict(
        cls,
        tensors: Mapping[str, Any],
        config: Mapping[str, Any] | Any,
        *,
        name: str,
        version: int = 1,
        base_model: str | None = None,
    ) -> AdapterBundle:
        """A bundle from LoRA tensors plus a PEFT config (a dict, ``LoraConfig.to_dict()``'s
        enums and sets included, or a ``peft.LoraConfig``), serialized in memory.

        Covers native-only checkpoints (no adapter_config.json). Keys may carry PEFT's adapter
        segment (``lora_A.default.weight``); it is dropped, as ``save_pretrained`` does.
        """
        config = peft_config_dict(config)
        tensors = normalize_lora_keys(tensors)
        shapes = {k: list(v.shape) for k, v in tensors.items()}
        if tensors and hasattr(next(iter(tensors.values())), "detach"):
            from safetensors.torch import save

            blob = save(
                {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                metadata={"format": "pt"},
            )
        else:
            import numpy as np
            from safetensors.numpy import save as np_save

            blob = np_save({k: np.ascontiguousarray(v) for k, v in tensors.items()})
        cfg_blob = _config_bytes(config)
        sources: dict[str, Source] = {SAFETENSORS: blob, ADAPTER_CONFIG: cfg_blob}
        digests = {
            SAFETENSORS: (sha256_bytes(blob), len(blob)),
            ADAPTER_CONFIG: (sha256_bytes(cfg_blob), len(cfg_blob)),
        }
        return cls._build(
            name=name,
            version=version,
            base_model=base_model,
            config=config,
            sources=sources,
            digests=digests,
            tensor_shapes=shapes,
        )

    @classmethod
    def from_peft_model(
        cls,
        model: Any,
        *,
        name: str,
        version: int = 1,
        adapter_name: str = "default",
        base_model: str | None = None,
    ) -> AdapterBundle:
        """A bundle of a ``peft.PeftModel``'s adapter, serialized in memory (no disk)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
        config = peft_config_dict(model.peft_config[adapter_name])
        return cls.from_state_dict(state, config, name=name, version=version, base_model=base_model)

    @classmethod
    def from_any(
        cls,
        source: Any,
        *,
        name: str,
        version: int = 1,
        config: Mapping[str, Any] | Any | None = None,
        base_model: str | None = None,
    ) -> AdapterBundle:
        """Dispatch on ``source``: a bundle, a directory path, a PeftModel, or a state dict."""
        if isinstance(source, AdapterBundle):
            return source.with_version(version, name=name)
        if isinstance(source, str | os.PathLike):
            return cls.from_dir(
                source, name=name, version=version, base_model=base_model, config=config
            )
        if hasattr(source, "peft_config"):
            return cls.from_peft_model(source, name=name, version=version, base_model=base_model)
        if isinstance(source, Mapping):
            if config is None:
                raise ManifestInvalid("a state dict needs config=<PEFT adapter config dict>")
            return cls.from_state_dict(
                source, config, name=name, version=version, base_model=base_model
            )
        raise ManifestInvalid(f"cannot build a bundle from {type(source).__name__}")
