"""A data loader for the mesh: :class:`DataLoader`.

[Note: the data order]
The loader's unit is the global batch: ``batch_size`` rows per optimizer step
over every data rank and micro-batch, as DeepSpeed's ``train_batch_size``.
Epoch ``e``'s rows are the dataset's indices permuted by
``np.random.default_rng([seed, e])`` (in order without ``shuffle``), cut into
``len(data) // batch_size`` global batches (the rest of the epoch is left
out, a different rest each epoch). Global batch ``b`` is cut into
``gradient_accumulation_steps`` micro-batches, and each micro-batch into equal
contiguous parts, one per data rank, as ``shard.split_batch`` cuts a batch.
So which rows form each micro-batch depends on the seed, the epoch and the
batch size alone, not on the number of ranks: the ranks' parts of a
micro-batch are disjoint and together are the micro-batch, at any world size.

The position is the number of global batches handed out. A step counts the
batches it takes (``TrainState.batches``, one per call, a skipped update's
included), and checkpoints keep that count, so ``loader.resume(state)`` puts
the loader where the run stopped, at the same or another world size, and the
run sees the same micro-batches it would have seen uninterrupted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ops import Communicator
from ops._types import tree_util
from ops.device._device import device_of_or_none
from shard.core._gather import MicroBatches
from shard.core._mesh import Mesh

if TYPE_CHECKING:
    from tqdm import tqdm

    from shard.core._state import TrainState

__all__ = ["DataLoader"]


class DataLoader:
    """Each data rank's part of every global batch, in an order fixed by the
    seed and the epoch (see [Note: the data order]).

    Args:
      data: a numpy array, or a pytree (dict, tuple, list) of arrays sharing
        their leading dimension (one row per sample); a Hugging Face
        ``datasets.Dataset`` (its columns as numpy arrays, or in the format it
        was given: ``with_format("torch")``); or a map-style dataset
        (``len(data)`` and ``data[i]``, such as a torch ``Dataset``), whose
        samples ``collate`` joins.
      batch_size: the global batch: rows per optimizer step over every data
        rank and micro-batch (DeepSpeed's ``train_batch_size``). It must divide
        into ``gradient_accumulation_steps`` x data ranks equal parts.
      mesh: a :class:`shard.Mesh`: the data ranks are its ``data`` axis (or
        HSDP's ``replicate`` x ``shard``); its model and pipe ranks of one data
        rank get the same rows. Or ``comm=``: one data axis. Neither: one rank.
      comm: the data ranks' communicator.
      gradient_accumulation_steps: micro-batches per step: each step is a
        ``shard.MicroBatches`` of that many (a plain batch for 1), as the
        step's option of that name takes them.
      shuffle: permute the rows every epoch (by ``seed`` and the epoch).
      seed: the order's seed; every rank gives the same.
      collate: joins a map-style dataset's samples into a batch. Default:
        torch's ``default_collate`` for samples holding torch tensors, else
        ``np.stack`` of each leaf.
      prefetch: batches made ahead on a background thread (0: none).
      progress: a progress bar over each epoch on the first rank (tqdm).

    Examples:
      >>> import numpy as np, ops, shard
      >>> data = {"x": np.arange(16)}
      >>> def rows(comm):
      ...     loader = shard.DataLoader(data, batch_size=8, comm=comm, shuffle=False)
      ...     return [b["x"].tolist() for b in loader]
      >>> ops.spawn(rows, 2)[1]  # data rank 1's half of each of the 2 global batches
      [[4, 5, 6, 7], [12, 13, 14, 15]]
    """

    def __init__(self, data: object, batch_size: int, *, mesh: Mesh | None = None,
                 comm: Communicator | None = None, gradient_accumulation_steps: int = 1,
                 shuffle: bool = True, seed: int = 0,
                 collate: Callable[[list], object] | None = None, prefetch: int = 2,
                 progress: bool = False) -> None:
        where = "DataLoader"
        if mesh is not None and comm is not None:
            raise TypeError(f"{where}: give the data ranks as mesh= or comm=, not both")
        if mesh is not None:
            if not isinstance(mesh, Mesh):
                raise TypeError(f"{where}: mesh must be a shard.Mesh; got {type(mesh).__name__}")
            self.rank, self.ranks = mesh.data_ranks()
            first = mesh.comm.rank == 0
        elif comm is not None:
            if not isinstance(comm, Communicator):
                raise TypeError(f"{where}: comm must be an ops.Communicator; got "
                                f"{type(comm).__name__}")
            self.rank, self.ranks, first = comm.rank, comm.world_size, comm.rank == 0
        else:
            self.rank, self.ranks, first = 0, 1, True
        for name, value, low in (("batch_size", batch_size, 1),
                                 ("gradient_accumulation_steps", gradient_accumulation_steps, 1),
                                 ("prefetch", prefetch, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{where}: {name} must be an int >= {low}; got {value!r}")
        k = int(gradient_accumulation_steps)
        if batch_size % (k * self.ranks):
            raise ValueError(f"{where}: batch_size {batch_size} does not split into "
                             f"gradient_accumulation_steps {k} x {self.ranks} data rank(s) "
                             "equal parts; give a multiple of their product")
        self.data, self.batch_size, self.micro = data, int(batch_size), k
        self.rows_per_rank = self.batch_size // (k * self.ranks)  # per micro-batch
        self._fetch = _fetcher(data, collate, where)
        self.length = _length(data, where)
        if self.length < self.batch_size:
            raise ValueError(f"{where}: the data has {self.length} rows, fewer than one global "
                             f"batch of {self.batch_size}")
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.prefetch, self.progress = int(prefetch), bool(progress) and first
        self.position = 0  # global batches handed out

    def __len__(self) -> int:
        """Global batches (steps) per epoch."""
        return self.length // self.batch_size

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.position // len(self)

    def resume(self, state: TrainState | int) -> DataLoader:
        """Continue after the batches ``state``'s steps took (``state.batches``,
        kept by checkpoints): the next batch is the one the run would have
        taken next, at any world size. Returns the loader."""
        batches = getattr(state, "batches", state)
        if isinstance(batches, bool) or not isinstance(batches, (int, np.integer, np.ndarray)) \
                or int(batches) < 0:
            raise TypeError(f"DataLoader.resume: give a TrainState (or a count of batches "
                            f">= 0); got {type(state).__name__}")
        self.position = int(batches)
        return self

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s row indices, in the order the global batches take
        them (see [Note: the data order])."""
        if not self.shuffle:
            return np.arange(self.length)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.length)

    def rows(self, position: int) -> list[np.ndarray]:
        """This rank's row indices in global batch ``position``: one array per
        micro-batch."""
        epoch, b = divmod(int(position), len(self))
        batch = self.order(epoch)[b * self.batch_size:(b + 1) * self.batch_size]
        per_micro = self.batch_size // self.micro
        n, r = self.rows_per_rank, self.rank
        return [batch[j * per_micro + r * n:j * per_micro + (r + 1) * n]
                for j in range(self.micro)]

    def batch(self, position: int) -> Any:
        """This rank's part of global batch ``position``: a batch, or a
        ``shard.MicroBatches`` of ``gradient_accumulation_steps`` of them."""
        parts = [self._fetch(idx) for idx in self.rows(position)]
        return parts[0] if self.micro == 1 else MicroBatches(parts)

    def __iter__(self) -> Iterator[Any]:
        """The batches from the current position to the end of its epoch; the
        position advances as each is handed out (the next ``iter`` goes on with
        the next epoch)."""
        end = (self.epoch + 1) * len(self)
        bar = self._bar()
        made = self._made(self.position, end)
        try:
            for position, item in made:
                self.position = position + 1
                if bar is not None:
                    bar.update(1)
                yield item
        finally:
            made.close()
            if bar is not None:
                bar.close()

    def _made(self, start: int, end: int) -> Generator[tuple[int, object], None, None]:
        """``(position, batch)`` from ``start`` to ``end``, made ``prefetch``
        ahead on a thread."""
        if not self.prefetch:
            for p in range(start, end):
                yield p, self.batch(p)
            return
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: tuple) -> bool:
            """Queue ``item`` unless the consumer has stopped; whether it was."""
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def make() -> None:
            try:
                for p in range(start, end):
                    if not put((p, self.batch(p), None)):
                        return
            except BaseException as e:  # handed to the consumer, raised there
                put((None, None, e))
                return
            put((None, None, None))

        thread = threading.Thread(target=make, name="shard.DataLoader", daemon=True)
        thread.start()
        try:
            while True:
                p, item, error = ready.get()
                if error is not None:
                    raise error
                if p is None:
                    return
                yield p, item
        finally:
            stop.set()
            thread.join()

    def _bar(self) -> tqdm | None:
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=len(self), initial=self.position % len(self), leave=False,
                    desc=f"epoch {self.epoch}", unit="batch")

    def __repr__(self) -> str:
        return (f"DataLoader({self.length} rows, batch_size={self.batch_size} x "
                f"{self.micro} micro-batch(es); data rank {self.rank} of {self.ranks}, "
                f"position {self.position}, epoch {self.epoch})")


def _length(data: Any, where: str) -> int:
    """The rows: an array pytree's shared leading dimension, or ``len(data)``."""
    if _is_arrays(data):
        sizes = {int(x.shape[0]) for x in tree_util().tree_leaves(data)}
        if len(sizes) != 1:
            raise ValueError(f"{where}: the arrays' leading dimensions differ ({sorted(sizes)}); "
                             "one row per sample in every array")
        return sizes.pop()
    try:
        return len(data)
    except TypeError:
        raise TypeError(f"{where}: data must be arrays (a pytree of them) or a map-style "
                        f"dataset with len() and [i]; got {type(data).__name__}") from None


def _is_arrays(data: object) -> bool:
    """Whether ``data`` is an array or a pytree (dict, tuple, list) of arrays."""
    if isinstance(data, (dict, tuple, list)) and not data:
        return False
    leaves = tree_util().tree_leaves(data)
    return bool(leaves) and all(hasattr(x, "shape") and getattr(x, "ndim", 0) >= 1
                                for x in leaves) and (
        hasattr(data, "shape") or isinstance(data, (dict, tuple, list)))


def _fetcher(data: Any, collate: object, where: str) -> Callable[[np.ndarray], object]:
    """Rows ``idx`` of ``data`` as one batch."""
    if _is_arrays(data):
        if collate is not None:
            raise TypeError(f"{where}: collate= joins a dataset's samples; arrays are sliced "
                            "as they are")
        tu = tree_util()
        return lambda idx: tu.tree_map(lambda x: x[idx], data)
    if hasattr(data, "column_names") and hasattr(data, "with_format") and collate is None:
        # a Hugging Face datasets.Dataset: its columns for many rows at once, as numpy
        # arrays unless the dataset was given a format (with_format("torch"), ...)
        table = data if (getattr(data, "format", None) or {}).get("type") else \
            data.with_format("numpy")
        return lambda idx: table[[int(i) for i in idx]]
    if collate is not None and not callable(collate):
        raise TypeError(f"{where}: collate must be a function of a list of samples; got "
                        f"{type(collate).__name__}")
    join = collate or _collate

    def fetch(idx: np.ndarray) -> object:
        many = getattr(data, "__getitems__", None)  # torch's batched fetch, where defined
        samples = many([int(i) for i in idx]) if many is not None else [data[int(i)]
                                                                          for i in idx]
        return join(list(samples))

    return fetch


def _collate(samples: list) -> object:
    """torch's ``default_collate`` for samples holding torch tensors; else each
    leaf stacked on its own device (numpy for host values, CuPy's ``stack``
    for CuPy arrays: no implicit copy to the host)."""
    tu = tree_util()
    leaves = tu.tree_leaves(samples[0])
    if any(type(x).__module__.startswith("torch") for x in leaves):
        from torch.utils.data import default_collate

        return default_collate(samples)
    return tu.tree_map(_stack, *samples)


def _stack(*xs: object) -> object:
    device = device_of_or_none(xs[0])
    if device is not None and not device.host:
        return device.xp.stack(xs)
    return np.stack([np.asarray(x) for x in xs])
