"""ZeRO-Offload and ZeRO-Infinity's disk tier: :class:`Offload`.

[Note: offload]
With ``offload=shard.Offload("host")`` the fp32 masters and Adam's moments live
in host memory while the compute params and gradients stay on the device; with
``Offload("disk", path=...)`` they live in files under ``path`` and only a few
chunks of them are in memory at a time. Either way the step is the same up to
the update: the gradients are reduced on the device, and then, unit by unit,

- each gradient shard is copied to the host (host tier on a GPU);
- the fused Adam kernel's CPU build (the same source as its CUDA build, which
  was measured bit-identical to it) updates the masters and moments there,
  writing the new compute-dtype params into a host buffer;
- those are copied into the device's compute params (the shard the next
  all-gather sends at stage 3; stages 1-2 all-gather them as without offload).

With ``Offload(..., params="host")`` ZeRO-3's compute-dtype shards stay in host
memory as well: each unit's shard is copied to the device just before its
all-gather, and the update writes the new ones in place on the host, so the
device holds only gathered units and gradients. So an offloaded run follows the
unoffloaded trajectory bit for bit. The host
decides whether the step's gradients are finite (one read back per step,
which the copies need anyway) before any of it starts, or, with
``overlap=True``, updates during the backward into a spare set that it keeps
only if they were (see [Note: overlapped offload]). On a GPU, gradients and new
params cross the bus through page-locked host buffers kept across steps.

The disk tier streams each unit in chunks of ``chunk_mb`` through three
buffers: a reader thread fills the next chunk's masters and moments while the
kernel runs on this one and a writer thread writes the previous one, so the
update costs about what the disk moves (12 bytes per fp32 param read and 12
written) and memory holds three chunks. A step never writes into an existing
file: it reads generation ``n`` and writes generation ``n + 1`` (one
safetensors file per rank, in the checkpoint's rank-file format), fsyncs it and
only then drops generation ``n``. A crash leaves the previous generation
intact, and :func:`shard.save` hard-links the current generation into the
checkpoint instead of copying it.

[Note: offload on a GPU]
On a lent H100 (2026-11-26), ``Offload("host", overlap=True)`` at stages 1 and
3 and ``Offload(params="host")`` at stage 3 (host and disk tiers, one and three
thread ranks), in bfloat16 with float32 masters, followed trajectories that
differed from the unoffloaded bfloat16 step's on the same GPU by up to 1e-2,
differently from run to run, and equal to it under ``CUDA_LAUNCH_BLOCKING=1``:
a race between work queued on the device and memory handed between JAX, CuPy
and the host, which the stand-in (whose operations are done when they return)
cannot show. Making JAX's arrays ready before CuPy reads them, and host-to-device
copies complete before they return, did not change it. The host and disk tiers
without these options matched the unoffloaded step bit for bit in all six runs,
but those tests run in float32, so the race may lie in the bfloat16 step rather
than in the two options: a likely place is a bfloat16 gradient's int16 bitcast
(``Device.from_jax``), a JAX temporary whose last reference can go while CuPy's
queued kernels still read it, its memory then free for XLA to reuse. Until a
GPU run settles it, the two options are refused on a CUDA device
(``check_offload_device``, before anything is built).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = ["DiskTier", "Offload"]

_ST_DTYPES = {"float32": "F32", "float64": "F64"}
KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Offload:
    """Where the masters and Adam's moments live (see [Note: offload]).

    Attributes:
      optimizer: ``"host"`` (host memory: ZeRO-Offload, for GPU state; a no-op
        for CPU state, which is in host memory already) or ``"disk"`` (files
        under ``path``: ZeRO-Infinity's NVMe tier, for CPU or GPU state).
      path: the disk tier's directory (each rank keeps its own files there).
      chunk_mb: the disk tier's streaming chunk, in MiB per buffer.
      params: ``"host"`` keeps ZeRO-3's compute-dtype shards in host memory too;
        each unit's shard is copied to the device just before its all-gather
        (stage 3 only; for device state). None: they stay on the device.
      overlap: the host tier's update of each unit runs during the backward, as
        soon as the unit's gradient shard is reduced, into a second set of
        masters and moments that the step keeps only if every gradient was
        finite (see [Note: overlapped offload]): the same trajectory, for twice
        the host memory. Not with ``clip_norm`` (the norm comes last).

    On a CUDA device ``overlap=True`` and ``params="host"`` are refused for now
    (see [Note: offload on a GPU]).
    """

    optimizer: str = "host"
    path: str | os.PathLike | None = None
    chunk_mb: int = 64
    params: str | None = None
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in ("host", "disk"):
            raise ValueError(f"Offload: optimizer must be 'host' or 'disk'; got "
                             f"{self.optimizer!r}")
        if self.optimizer == "disk" and self.path is None:
            raise ValueError("Offload('disk') needs path=, a directory for the disk tier")
        if self.optimizer == "host" and self.path is not None:
            raise ValueError("Offload: path= is for optimizer='disk'")
        if self.params not in (None, "host"):
            raise ValueError(f"Offload: params must be None or 'host'; got {self.params!r}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"Offload: overlap must be True or False; got {self.overlap!r}")
        if self.overlap and self.optimizer != "host":
            raise ValueError("Offload: overlap=True is for optimizer='host' (the disk tier "
                             "streams units in file order)")
        if isinstance(self.chunk_mb, bool) or not isinstance(self.chunk_mb, int) or \
                self.chunk_mb < 1:
            raise ValueError(f"Offload: chunk_mb must be an int >= 1; got {self.chunk_mb!r}")


class DiskTier:
    """One rank's generation files of masters and moments (see [Note: offload])."""

    def __init__(self, policy: Offload, rank: int, sizes: list[int], dtype: DTypeLike) -> None:
        if policy.path is None:
            raise ValueError("Offload('disk') needs path=, a directory for the disk tier")
        self.dir = Path(policy.path) / f"rank-{rank:05d}"
        self.dtype = np.dtype(dtype)
        self.sizes = list(sizes)
        self.chunk = max(1, (policy.chunk_mb << 20) // self.dtype.itemsize)
        header, self.offsets = _header(self.sizes, self.dtype)
        self.header = header
        self.data_start = len(header)
        self.bytes = self.data_start + 3 * sum(self.sizes) * self.dtype.itemsize
        self.gen = 0
        # this tier's files, beside any others': an id() would be reused by a
        # later tier once this one is collected, and its files taken for that one's
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.dir.mkdir(parents=True, exist_ok=True)

    # -- files ------------------------------------------------------------------
    def new_file(self) -> Path:
        """A fresh generation file: header written, data zero (sparse)."""
        self.gen += 1
        path = self.dir / f"gen-{self.token}-{self.gen:08d}.safetensors"
        with open(path, "wb") as f:
            f.write(self.header)
            f.truncate(self.bytes)
        return path

    def maps(self, path: Path) -> dict[str, list[np.ndarray]]:
        """Per kind, per unit: read-only memory maps of ``path``'s buffers. The file's name
        goes when the last of them (and of their views) is collected: a state
        nobody holds leaves no file behind (a checkpoint's hard link stays)."""
        owner = _FileOwner(path)
        out: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
        for (kind, u), off in self.offsets.items():
            n = self.sizes[u]
            m: np.ndarray = np.zeros(0, self.dtype)
            if n:
                m = np.memmap(path, self.dtype, "r", self.data_start + off, (n,))
                setattr(m, "owner", owner)  # noqa: B010 (keeps the file while a view lives)
            out[kind].append(m)
        return out

    def write(self, path: Path, kind: str, u: int, buf: np.ndarray) -> None:
        """Write unit ``u``'s buffer of ``kind`` into ``path``."""
        fd = os.open(path, os.O_WRONLY)
        try:
            _pwrite_all(fd, np.ascontiguousarray(buf, self.dtype).data.cast("B"),
                        self.data_start + self.offsets[kind, u])
        finally:
            os.close(fd)

    def finish(self, path: Path) -> None:
        """Make ``path`` durable and drop its pages from the page cache."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            _drop_cache(fd, 0, 0)
        finally:
            os.close(fd)

    def retire(self, path: Path) -> None:
        """Remove an old generation's name (checkpoint hard links keep their data)."""
        _unlink(str(path))

    # -- the streamed update ------------------------------------------------------
    def update(self, src: Path,
               run_chunk: Callable[[int, int, int, np.ndarray, np.ndarray, np.ndarray], None]
               ) -> Path:
        """Stream ``src``'s masters and moments through ``run_chunk(u, lo, hi, p, m,
        v)`` (which updates them in place) into a new generation; returns its
        path once it is on disk."""
        dst = self.new_file()
        chunks = [(u, lo, min(lo + self.chunk, n)) for u, n in enumerate(self.sizes)
                  for lo in range(0, n, self.chunk)]
        free: queue.Queue = queue.Queue()  # three buffer sets bound the memory
        for _ in range(3):
            free.put([np.empty(self.chunk, self.dtype) for _ in KINDS])
        ready: queue.Queue = queue.Queue()
        done: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        size = self.dtype.itemsize
        rfd, wfd = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)

        def reader() -> None:
            try:
                for u, lo, hi in chunks:
                    bufs = free.get()
                    if bufs is None or errors:
                        return
                    for kind, buf in zip(KINDS, bufs, strict=True):
                        off = self.data_start + self.offsets[kind, u] + lo * size
                        view = memoryview(buf[:hi - lo]).cast("B")
                        _pread_all(rfd, view, off)
                        _drop_cache(rfd, off, len(view))
                    ready.put((u, lo, hi, bufs))
            except BaseException as e:  # handed to the caller
                errors.append(e)
            finally:
                ready.put(None)

        def writer() -> None:
            try:
                while (item := done.get()) is not None:
                    u, lo, hi, bufs = item
                    for kind, buf in zip(KINDS, bufs, strict=True):
                        off = self.data_start + self.offsets[kind, u] + lo * size
                        _pwrite_all(wfd, memoryview(buf[:hi - lo]).cast("B"), off)
                    free.put(bufs)
            except BaseException as e:
                errors.append(e)
            finally:
                free.put(None)  # the reader stops at its next chunk

        threads = [threading.Thread(target=reader, name="zeroshard-disk-read", daemon=True),
                   threading.Thread(target=writer, name="zeroshard-disk-write", daemon=True)]
        for t in threads:
            t.start()
        finished = False
        try:
            while (item := ready.get()) is not None and not errors:
                u, lo, hi, bufs = item
                n = hi - lo
                run_chunk(u, lo, hi, *(b[:n] for b in bufs))
                done.put(item)
            finished = not errors
        finally:
            done.put(None)
            free.put(None)
            for t in threads:
                t.join()
            os.close(rfd)
            os.close(wfd)
            if not finished or errors:  # a partial generation is never left behind
                self.retire(dst)
        if errors:
            raise errors[0]
        self.finish(dst)
        return dst


class _FileOwner:
    """Removes a generation file's name once nothing references it."""

    def __init__(self, path: Path) -> None:
        weakref.finalize(self, _unlink, str(path))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _header(sizes: list[int], dtype: np.dtype) -> tuple[bytes, dict[tuple[str, int], int]]:
    """A safetensors header for master/u, exp_avg/u, exp_avg_sq/u (the checkpoint's
    rank-file names), and each buffer's offset in the data section."""
    meta, offsets, pos = {}, {}, 0
    for u, n in enumerate(sizes):
        for kind in KINDS:
            offsets[kind, u] = pos
            meta[f"{kind}/{u}"] = {"dtype": _ST_DTYPES[str(dtype)], "shape": [n],
                                   "data_offsets": [pos, pos + n * dtype.itemsize]}
            pos += n * dtype.itemsize
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 64)  # data 64-byte aligned in the file
    return len(text).to_bytes(8, "little") + text, offsets


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read from the disk tier at byte {offset}")
        view, offset = view[n:], offset + n


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _drop_cache(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
