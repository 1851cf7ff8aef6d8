"""A step's metrics, read back from the device only when they are looked at."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ops._types import Array

__all__ = ["StepMetrics"]


class StepMetrics(Mapping):
    """The metrics of one step: a read-only mapping.

    Values the host already knows (``lr``, ``loss_scale``, ``skipped``,
    ``time_ms``: the step's time split, see [Note: step profile], and
    ``tokens_per_s`` when the step was told its ``tokens``) are there at once.
    ``loss`` and ``grad_norm`` come from a small device array that is copied to
    the host at the first look at any of them, in one read: a step on a GPU
    whose metrics nobody reads synchronises with the device not at all.
    """

    def __init__(self, known: dict[str, Any], pending: Array | None = None,
                 finish: Callable[[np.ndarray], dict[str, object]] | None = None,
                 to_host: Callable[[Array], np.ndarray] | None = None) -> None:
        self._known = dict(known)
        self._pending: tuple[Array, Callable[[np.ndarray], dict[str, object]],
                             Callable[[Array], np.ndarray]] | None = None
        if pending is not None:
            if finish is None or to_host is None:
                raise TypeError("StepMetrics: a pending device array needs finish= and to_host=")
            self._pending = (pending, finish, to_host)

    def add(self, **values: object) -> None:
        """Values the host knows, added after the step (its times)."""
        self._known.update(values)

    def _resolve(self) -> None:
        if self._pending is not None:
            pending, finish, to_host = self._pending
            self._known.update(finish(to_host(pending)))
            self._pending = None

    def __getitem__(self, key: str) -> Any:
        if key not in self._known:
            self._resolve()
        return self._known[key]

    def __iter__(self) -> Iterator[str]:
        self._resolve()
        return iter(self._known)

    def __len__(self) -> int:
        self._resolve()
        return len(self._known)

    def __repr__(self) -> str:
        self._resolve()
        return repr(self._known)
