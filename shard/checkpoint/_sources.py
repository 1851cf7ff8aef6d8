"""Where a saved leaf's rows are read from: the rank files of one checkpoint, a
pipeline's stage directory, or a tensor-parallel checkpoint's model parts
joined (and one model rank's slice of a joined leaf); each file checked against
its manifest entry before it is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shard.checkpoint._files import CheckpointError, _sha256
from shard.core._specs import Split, join_split, take_split

__all__ = ["Joined", "Sliced", "source_of", "verify_files"]


def verify_files(path: Path, manifest: dict, needed: set[int]) -> None:
    for r in sorted(needed):
        entry = manifest["files"][r] if manifest["stage"] else manifest["files"][0]
        f = path / entry["file"]
        if not f.exists():
            raise CheckpointError(f"{f}: missing shard file")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{f}: truncated or altered ({f.stat().st_size} bytes, the "
                                  f"manifest says {entry['bytes']})")
        if _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch (SHA-256 differs from the manifest)")


class Source:
    """Rows of one saved leaf, read from whichever old rank files hold them."""

    def __init__(self, path: Path, manifest: dict, entry: dict) -> None:
        self.path, self.manifest, self.entry = path, manifest, entry
        self.world = manifest["world_size"]
        shape = entry["shape"]
        self.rows = shape[0] if shape else 1
        self.row_size = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        self.sharded = entry["spec"] == "Shard(0)"
        self.rpr = entry["rows_per_rank"]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry["shape"])

    def ranks_for(self, lo: int, hi: int) -> list[int]:
        if not self.sharded or hi <= lo:
            return [0]
        return list(range(lo // self.rpr, (hi - 1) // self.rpr + 1))

    def needs(self, lo: int, hi: int) -> set[tuple[Path, int]]:
        """The (directory, rank file) pairs rows [lo, hi) are read from."""
        return {(self.path, r) for r in self.ranks_for(lo, hi)}

    def manifests(self) -> dict[Path, dict]:
        return {self.path: self.manifest}

    def read(self, handles: dict, kind: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of this leaf, as a (hi - lo, row_size) float32 array."""
        out = np.zeros((max(hi - lo, 0), self.row_size), self.manifest["master_dtype"])
        unit, off = self.entry["unit"], self.entry["offset"]
        for r in self.ranks_for(lo, hi):
            first = r * self.rpr if self.sharded else 0
            a, b = max(lo, first), min(hi, first + self.rpr if self.sharded else self.rows)
            if b <= a:
                continue
            start = off + (a - first) * self.row_size
            sl = handles[self.path, r].get_slice(f"{kind}/{unit}")[
                start:start + (b - a) * self.row_size]
            out[a - lo:b - lo] = np.asarray(sl).reshape(b - a, self.row_size)
        return out


class Joined:
    """A leaf saved split over model ranks: every part's whole leaf joined along
    its split dimension (see [Note: tensor-parallel checkpoints])."""

    def __init__(self, parts: list[Source], split: Split, shape: list[int]) -> None:
        self.parts, self.split, self.shape = parts, split, tuple(shape)
        self.rows = self.shape[0] if self.shape else 1

    def needs(self, lo: int, hi: int) -> set[tuple[Path, int]]:
        return set().union(*(p.needs(0, p.rows) for p in self.parts))

    def manifests(self) -> dict[Path, dict]:
        return {k: v for p in self.parts for k, v in p.manifests().items()}

    def read(self, handles: dict, kind: str, lo: int, hi: int) -> np.ndarray:
        whole = join_split([p.read(handles, kind, 0, p.rows).reshape(p.shape)
                            for p in self.parts], self.split)
        return whole.reshape(self.rows, -1)[lo:hi]


class Sliced:
    """One model rank's slice (its :class:`Split`) of a leaf read whole."""

    def __init__(self, src: Source | Joined, split: Split, rank: int, size: int) -> None:
        self.src, self.split, self.rank, self.size = src, split, rank, size
        shape = list(src.shape)
        shape[split.dim] //= size
        self.shape = tuple(shape)
        self.rows = self.shape[0] if self.shape else 1

    def needs(self, lo: int, hi: int) -> set[tuple[Path, int]]:
        return self.src.needs(0, self.src.rows)

    def manifests(self) -> dict[Path, dict]:
        return self.src.manifests()

    def read(self, handles: dict, kind: str, lo: int, hi: int) -> np.ndarray:
        whole = self.src.read(handles, kind, 0, self.src.rows).reshape(self.src.shape)
        mine = take_split(whole, self.split, self.rank, self.size)
        return mine.reshape(self.rows, -1)[lo:hi]


def source_of(path: Path, manifest: dict, entry: dict) -> Any:
    """Where a manifest entry's rows are read from: one checkpoint, a
    pipeline's stage, or a tensor-parallel checkpoint's parts joined."""
    parts = entry.get("model_parts")
    if parts is not None:
        srcs = [Source(path / e["part"], manifest["parts"][e["part"]], e) for e in parts]
        return srcs[0] if entry["model_dim"] is None else Joined(srcs, entry["model_dim"],
                                                                  entry["shape"])
    part = entry.get("part")  # a pipelined checkpoint's stage directory
    return Source(path / part, manifest["parts"][part], entry) if part else \
        Source(path, manifest, entry)
