"""What an agent accepts: its upload limits, each field one ``lorafleet agent`` option."""

from __future__ import annotations

from dataclasses import dataclass

import click

from lorafleet._settings import setting

__all__ = ["UploadLimits"]


@dataclass
class UploadLimits:
    max_file_bytes: int = setting(
        128 << 30, flag="--max-file-bytes", help="Largest file an upload may declare."
    )
    quota_bytes: int | None = setting(
        None, flag="--quota-bytes", type=int, help="Default: free disk minus 1 GiB."
    )
    ttl_s: float = setting(600.0, flag="--upload-ttl", help="Seconds an idle upload session lives.")
    direct_io_min_bytes: int | None = setting(
        64 << 20,
        flag="--direct-io-min-bytes",
        type=click.IntRange(min=0),
        none_as=0,
        help="Files this large are written with O_DIRECT, past the page cache; 0: never.",
    )
    """Copying every received byte into the page cache costs more CPU than hashing it; a direct
    write is a DMA. Small files stay cached for the engine that loads them next."""
