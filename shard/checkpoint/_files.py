"""What every part of the checkpoint code shares: its error and the file checksum."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupt, too new, or does not fit."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
