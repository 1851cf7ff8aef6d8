"""Asynchronous checkpoints: :func:`shard.async_save`.

[Note: asynchronous saves]
``async_save`` is ``save`` split in two, as torch's ``dcp.async_save``. On the
caller's thread, at the same point of every rank's loop (it is a collective),
each rank copies what it will write into host memory (its unit buffers, the
optimizer's other leaves; device state through explicit copies; rank 0 also
the manifest's fields and a torch module's buffers), and rank 0 prepares
``<path>.tmp``. Then it returns, and the training steps go on while a thread
per rank writes its rank file there, fsyncs it and drops a receipt beside it
(its SHA-256 and size). Rank 0's thread waits for every rank's receipt,
writes the manifest and renames the directory into place as ``save`` does,
so a checkpoint is complete or absent: a process killed during the write
leaves ``<path>.tmp`` incomplete and the previous checkpoint loadable.

No collective runs off the caller's thread (a communicator is not shared
with the steps running meanwhile): the ranks meet through files, which a
checkpoint directory needs anyway (one manifest names every rank's file).
:meth:`AsyncSave.wait` returns once the checkpoint is in place (on every
rank: the others watch for ``<path>.tmp`` to be renamed), and raises what
went wrong on any rank. A rank's next ``save`` or ``async_save`` of the same
path waits for its previous one first, and so does the interpreter at exit
(a minute at most once nothing changes: a peer that died will not write).
The copy costs one more copy of the rank's state in host memory while the
write runs; the disk tier's state is written by ``save`` (its file is the
rank file, changing every step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ops import Communicator
from shard.checkpoint._files import CheckpointError
from shard.core._state import TrainState

if TYPE_CHECKING:
    import numpy as np

    from shard.step._plan import Plan

__all__ = ["AsyncSave", "async_save", "wait_pending"]

log = logging.getLogger(__name__)

_pending: dict[tuple[str, int], AsyncSave] = {}  # (path, id(comm)) -> this rank's last save
_lock = threading.Lock()
_FAILED = "FAILED"  # rank 0 writes its error here when the save cannot complete


class AsyncSave:
    """A checkpoint being written in the background (see [Note: asynchronous
    saves]); :meth:`wait` for it before relying on it."""

    def __init__(self, path: Path, work: Callable[[], None] | None) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None
        if work is not None:
            self._thread = threading.Thread(target=self._run, args=(work,),
                                            name=f"zeroshard-save:{path.name}")
            self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for wait(), which raises it on the caller
            self._error = e
            log.error("async_save of %s failed (wait() raises it): %s: %s", self.path,
                      type(e).__name__, e)

    def done(self) -> bool:
        """True once the write has ended (completed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is in place and return its path; raise what
        failed. ``timeout`` (seconds): a TimeoutError if it is still running."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"async_save of {self.path}: still writing after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    result = wait  # concurrent.futures' name for it


def wait_pending(path: Path, comm: Communicator) -> bool:
    """Wait for this rank's last asynchronous save of ``path``, if any, and raise
    its error unless its ``wait()`` already has; whether there was one."""
    with _lock:
        pending = _pending.pop((str(path.absolute()), id(comm)), None)
    if pending is not None and not pending._reported:
        pending.wait()
    return pending is not None


def async_save(state: TrainState, path: str | os.PathLike, *, comm: Communicator,
               extra: object = None, timeout: float = 1800.0) -> AsyncSave:
    """Start writing a checkpoint of ``state`` and return while it is written (a
    collective: every rank calls it at the same point, as :func:`shard.save`).

    The state is copied before this returns, so the steps that follow may
    change it. The checkpoint, once in place, is the one :func:`shard.save`
    would have written, and :func:`shard.load` reads it.

    Args:
      state: as :func:`shard.save`'s.
      path: as :func:`shard.save`'s.
      comm: as :func:`shard.save`'s.
      extra: as :func:`shard.save`'s.
      timeout: seconds rank 0 waits for the other ranks' files, and they for
        its manifest, with nothing changing in ``<path>.tmp`` before the save
        fails with a CheckpointError naming the ranks it waited for (60 s
        once the main thread has ended: a dead peer does not hold the
        interpreter's exit).

    Returns:
      An :class:`AsyncSave`: ``wait()`` returns the path once the checkpoint is
      complete (and raises what failed), ``done()`` says whether it ended.

    Example::

        pending = shard.async_save(state, "ckpt", comm=comm, extra={"next": i + 1})
        state, metrics = step(state, batch)  # runs while the files are written
        pending.wait()
    """
    from shard.checkpoint import _checkpoint as ck

    path = Path(path)
    ck.check_savable(state, extra, "async_save")
    plan = ck.step_plan(state, "async_save")
    _check_async(state, plan)
    key = (str(path.absolute()), id(comm))
    wait_pending(path, comm)
    c = plan.config if plan is not None else None
    replicas = c.replicate if c is not None else None
    tmp = path.with_name(path.name + ".tmp")
    if c is not None and replicas is not None:  # the first replica writes (see [Note: replicas])
        if comm.world_size != c.comm.world_size:
            raise ValueError(f"async_save: this state's step shards over "
                             f"{c.comm.world_size} ranks with replicas: pass comm= "
                             f"that communicator (the step's comm), not one of {comm.world_size}")
        with ck.every_rank("async_save", replicas):
            replicas.barrier()  # this rank's counterparts are done with the previous save
        if replicas.rank != 0:
            with ck.every_rank("async_save", replicas):
                replicas.barrier()  # the first replica's rank 0 has made tmp
            handle = AsyncSave(path, lambda: _await_commit(path, tmp, timeout))
            with _lock:
                _pending[key] = handle
            return handle
    with ck.every_rank("async_save", comm):
        comm.barrier()  # every rank has seen its previous save of this path committed
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    with ck.every_rank("async_save", comm):
        comm.barrier()
    if replicas is not None:
        with ck.every_rank("async_save", replicas):
            replicas.barrier()
    writes = comm.rank == 0 or state.meta.stage > 0
    tensors = ck.rank_tensors(state, copy=True) if writes else None  # the snapshot
    manifest = None
    if comm.rank == 0:
        module = ck.write_module_file(plan, tmp)
        manifest = ck.manifest(state, [], extra, module, ck.write_model_state_file(state, tmp))
    rank, world = comm.rank, comm.world_size

    def work() -> None:
        _write(tensors, path, tmp, manifest, rank, world, timeout)

    handle = AsyncSave(path, work)
    with _lock:
        _pending[key] = handle
    return handle


def _check_async(state: TrainState, plan: Plan | None) -> None:
    """What async_save refuses: a tensor-parallel state, the disk tier."""
    if plan is not None and plan.config.tensor_parallel is not None:
        raise NotImplementedError("async_save: a tensor-parallel state is saved by shard.save "
                                  "(one checkpoint per model rank, see [Note: tensor-parallel "
                                  "checkpoints])")
    if state.meta.offload == "disk":
        raise TypeError("async_save: the disk tier's file is its rank file and changes every "
                        "step; save it with shard.save(...)")


def _write(tensors: dict[str, np.ndarray] | None, path: Path, tmp: Path, manifest: dict | None,
           rank: int, world: int, timeout: float) -> None:
    """A rank's part of an async save, on its writer thread: its rank file (where
    it writes one) and its receipt; rank 0 (the one holding ``manifest``)
    commits once every receipt is in, the others wait for the commit. A
    failure is written as the rank's receipt (rank 0's also as the failure
    file) before it is raised."""
    from shard.checkpoint import _checkpoint as ck

    try:
        digest, size = (ck.write_tensors(tensors, tmp / f"rank-{rank:05d}.safetensors")
                        if tensors is not None else ("", 0))
        _receipt(tmp, rank, {"sha256": digest, "bytes": size})
        if manifest is not None:  # rank 0's
            _commit(path, tmp, manifest, world, timeout)
    except BaseException as e:  # the other ranks learn of it from the files
        _receipt(tmp, rank, {"error": f"{type(e).__name__}: {e}"})
        if rank == 0:  # whole (rename), so that a waiting rank never reads it half written
            with contextlib.suppress(OSError):
                part = tmp / f"{_FAILED}.part"
                part.write_text(f"{type(e).__name__}: {e}")
                os.replace(part, tmp / _FAILED)
        raise
    if rank != 0:
        _await_commit(path, tmp, timeout)


def _receipt(tmp: Path, rank: int, content: dict) -> None:
    """This rank's receipt, written whole (rename) so that it is read whole."""
    with contextlib.suppress(OSError):
        part = tmp / f"rank-{rank:05d}.json.part"
        part.write_text(json.dumps(content))
        os.replace(part, tmp / f"rank-{rank:05d}.json")


def _commit(path: Path, tmp: Path, manifest: dict, world: int, timeout: float) -> None:
    from shard.checkpoint import _checkpoint as ck

    receipts = _receipts(tmp, world, timeout)
    failed = {r: rec["error"] for r, rec in enumerate(receipts) if "error" in rec}
    if failed:
        raise CheckpointError(f"async_save of {path}: ranks {sorted(failed)} could not write "
                              f"their files ({next(iter(failed.values()))}); the checkpoint was "
                              "not completed (the previous one is kept)")
    manifest["files"] = [{"file": f"rank-{r:05d}.safetensors", "sha256": rec["sha256"],
                          "bytes": int(rec["bytes"])}
                         for r, rec in enumerate(receipts) if rec["bytes"] > 0]
    for r in range(world):
        (tmp / f"rank-{r:05d}.json").unlink()
    ck.commit(path, tmp, manifest)


class _Watch:
    """Polls ``tmp`` for what the other ranks write. Patience runs from the last
    change there (a file appeared or grew), so a slow disk is waited for and a
    dead rank is not: ``timeout`` seconds, or ``AT_EXIT`` once the main thread
    has ended (the interpreter is waiting for this thread to exit)."""

    AT_EXIT = 60.0

    def __init__(self, tmp: Path, timeout: float) -> None:
        self.tmp, self.timeout = tmp, timeout
        self.seen: tuple = ()
        self.since = time.monotonic()
        self.pause = 0.005

    def patient(self) -> bool:
        """Sleep a little; False once there was no change for too long."""
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, 0.2)
        with contextlib.suppress(OSError):
            now = tuple(sorted((f.name, f.stat().st_size) for f in self.tmp.iterdir()))
            if now != self.seen:
                self.seen, self.since = now, time.monotonic()
        limit = self.timeout if threading.main_thread().is_alive() else \
            min(self.timeout, self.AT_EXIT)
        return time.monotonic() - self.since < limit


def _receipts(tmp: Path, world: int, timeout: float) -> list[dict]:
    watch = _Watch(tmp, timeout)
    while True:
        missing = [r for r in range(world) if not (tmp / f"rank-{r:05d}.json").exists()]
        if not missing:
            return [json.loads((tmp / f"rank-{r:05d}.json").read_text()) for r in range(world)]
        if not watch.patient():
            raise CheckpointError(f"async_save of {tmp.name[:-4]}: ranks {missing} wrote "
                                  f"nothing for {time.monotonic() - watch.since:.0f} s; the "
                                  "checkpoint was not completed (the previous one is kept)")


def _await_commit(path: Path, tmp: Path, timeout: float) -> None:
    watch = _Watch(tmp, timeout)
    while tmp.exists():
        failed = tmp / _FAILED
        if failed.exists():
            raise CheckpointError(f"async_save of {path}: rank 0 could not complete it: "
                                  f"{failed.read_text()}")
        if not watch.patient():
            raise CheckpointError(f"async_save of {path}: rank 0 did not complete it (nothing "
                                  f"changed for {time.monotonic() - watch.since:.0f} s); the "
                                  "previous checkpoint is kept")
