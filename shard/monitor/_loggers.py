"""Step metrics to files: :class:`CSVLogger` and :class:`TensorBoardLogger`
(DeepSpeed's ``csv_monitor`` and ``tensorboard``).

A logger is a callable ``(step, metrics)``; pass it to a transform
(``shard.zero3(..., loggers=[shard.CSVLogger("run.csv")])``, called on rank 0
after every step) or call it yourself. Nested values are flattened with ``/``
(``time_ms/forward``), booleans written as 0 or 1. Reading a step's metrics
waits for its loss on the device, so ``every=N`` logs every N-th step only.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO, TypeVar

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["CSVLogger", "TensorBoardLogger", "flatten_metrics"]

_E = TypeVar("_E", bound="_Every")


def flatten_metrics(metrics: Mapping, prefix: str = "") -> dict[str, float]:
    """``{"loss": 2.0, "time_ms": {"step": 9.0}}`` -> ``{"loss": 2.0, "time_ms/step": 9.0}``."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, f"{name}/"))
        else:
            out[name] = float(value)
    return out


class _Every:
    def __init__(self, every: int) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1; got {every!r}")
        self.every = every

    def __call__(self, step: int, metrics: Mapping) -> None:
        if step % self.every == 0:
            self.write(int(step), flatten_metrics(metrics))

    def write(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def __enter__(self: _E) -> _E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the file (the next write reopens it)."""


class CSVLogger(_Every):
    """One row per logged step: ``step`` and every metric, flushed at once (a
    crash loses no logged row). An existing file is appended to, so a resumed
    run continues its log; its columns must then be the same.

    Examples:
      >>> import tempfile, pathlib, shard
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.csv"
      >>> log = shard.CSVLogger(path)
      >>> log(1, {"loss": 2.5, "skipped": False, "time_ms": {"step": 12.0}})
      >>> print(path.read_text().strip())
      step,loss,skipped,time_ms/step
      1,2.5,0.0,12.0
    """

    def __init__(self, path: str | os.PathLike, *, every: int = 1) -> None:
        super().__init__(every)
        self.path = Path(path)
        self.columns: list[str] | None = None
        self._file: TextIO | None = None

    def write(self, step: int, values: dict[str, float]) -> None:
        if self._file is None:
            if self.path.exists() and self.path.stat().st_size > 0:
                with self.path.open(newline="") as f:
                    self.columns = next(csv.reader(f))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", newline="")
            if self.columns is None:
                self.columns = ["step", *values]
                csv.writer(self._file).writerow(self.columns)
        columns = self.columns or ["step", *values]  # set above with the file
        if set(values) != set(columns[1:]):
            raise ValueError(f"CSVLogger({str(self.path)!r}): step {step} has metrics "
                             f"{sorted(values)} but the file's columns are "
                             f"{columns[1:]}; log the same metrics every step, or "
                             "use a new file")
        csv.writer(self._file).writerow([step, *(values[c] for c in columns[1:])])
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardLogger(_Every):
    """Each metric as a TensorBoard scalar (tag = its flattened name), through
    ``torch.utils.tensorboard`` (``pip install tensorboard``)."""

    def __init__(self, log_dir: str | os.PathLike, *, every: int = 1) -> None:
        super().__init__(every)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch, or the tensorboard package, is missing
            raise ImportError("TensorBoardLogger writes through torch.utils.tensorboard, which "
                              f"needs torch and tensorboard: pip install tensorboard ({e})"
                              ) from e
        self.log_dir = str(log_dir)
        self._writer_type = SummaryWriter
        self._writer: SummaryWriter | None = None

    def write(self, step: int, values: dict[str, float]) -> None:
        if self._writer is None:
            self._writer = self._writer_type(log_dir=self.log_dir)
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
