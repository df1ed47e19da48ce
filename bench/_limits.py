"""The machine's own limits, measured in the same run as a benchmark's figures, and the random
test files and adapters the upload and transfer benchmarks send."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

from lorafleet.protocol.manifest import FileEntry, Manifest

CHUNK = 1 << 20
MiB = 1 << 20
CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"}


def med(xs: list[float]) -> float:
    """The median (NaN for no samples): the figure the benchmarks quote on a noisy machine."""
    return statistics.median(xs) if xs else float("nan")


def sha256_rate(path: Path) -> float:
    """Bytes/s of sha256 over ``path`` (cached) in 1 MiB reads."""
    size = path.stat().st_size
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return size / (time.perf_counter() - t)


def write_fsync_rate(scratch: Path, size: int) -> float:
    """Bytes/s of writing ``size`` bytes to ``scratch``'s disk and fsyncing them once."""
    buf = os.urandom(CHUNK)
    out = scratch / "write-limit"
    t = time.perf_counter()
    with open(out, "wb") as dst:
        for _ in range(size // CHUNK):
            dst.write(buf)
        dst.flush()
        os.fsync(dst.fileno())
    rate = size / (time.perf_counter() - t)
    out.unlink()
    return rate


def make_file(path: Path, mib: int) -> FileEntry:
    """A file of random bytes; its sha256 computed while writing (as a bundle build would)."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for start in range(0, mib, 16):
            buf = os.urandom(min(16, mib - start) * MiB)
            h.update(buf)
            f.write(buf)
    return FileEntry(path="adapter_model.safetensors", size=mib * MiB, sha256=h.hexdigest())


def manifest_for(entry: FileEntry, name: str, version: int) -> Manifest:
    """A manifest of ``entry`` (the weights) and a small LoRA config, as the agent expects."""
    cfg = json.dumps(CONFIG).encode()
    config = FileEntry(
        path="adapter_config.json", size=len(cfg), sha256=hashlib.sha256(cfg).hexdigest()
    )
    return Manifest(name=name, version=version, config=CONFIG, files=(entry, config))


def make_adapters(model: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` real PEFT adapters (all-linear, rank ``rank``), each with different bytes."""
    import torch

    from lorafleet.testing import ALL_LINEAR, make_peft_model

    peft = make_peft_model(model, r=rank, seed=14, target_modules=ALL_LINEAR)
    lora = [p for n, p in peft.named_parameters() if "lora_" in n]
    dirs = []
    with torch.no_grad():
        for i in range(count):
            for p in lora:
                p.mul_(1.0 + 1e-3)  # new bytes everywhere, same scale
            d = out / f"adapter{i:02d}"
            peft.save_pretrained(str(d))
            dirs.append(d)
    os.sync()
    return dirs
