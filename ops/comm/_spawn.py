"""Thread ranks in one process: :func:`ops.spawn` runs a function on each, over one
:class:`~ops.ThreadGroup` (see [Note: thread collectives] in ``_threads.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ops.comm._threads import DEFAULT_TIMEOUT, ThreadGroup
from ops.kernels._cpu import share_cores

__all__ = ["spawn"]

_T = TypeVar("_T")


def spawn(fn: Callable[..., _T], world_size: int, *args: object,
          timeout: float = DEFAULT_TIMEOUT) -> list[_T]:
    """Run ``fn(comm, *args)`` on ``world_size`` thread ranks; return results by rank.

    Each rank gets its own :class:`ThreadCommunicator`. If any rank raises, the
    others' pending and future collectives fail at once (:class:`PeerFailed`)
    and the first failure is re-raised here, annotated with its rank.

    Examples:
      >>> import numpy as np, ops
      >>> ops.spawn(lambda comm: ops.all_gather(comm, np.array([comm.rank])).tolist(), 3)
      [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    """
    group = ThreadGroup(world_size, timeout)
    comms = group.communicators()
    results: list[Any] = [None] * world_size  # each rank's _T, once it returned
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        share_cores(world_size)  # see [Note: kernel threads of thread ranks]
        try:
            results[rank] = fn(comms[rank], *args)
            comms[rank].close()
            group.returned(rank)
        except BaseException as exc:  # re-raised in the caller below
            errors[rank] = exc
            group.fail(rank, exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"zeroshard-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():  # join in slices: Ctrl-C reaches the main thread at once
                t.join(0.1)
    except KeyboardInterrupt:
        # Every rank fails at its next collective (within one unit's compute);
        # wait for them so nothing keeps running after control returns.
        group.fail(-1, KeyboardInterrupt("interrupted"))
        for t in threads:
            t.join(group.timeout)
        raise
    if errors:
        rank, exc = group.failure if group.failure and group.failure[0] in errors else \
            min(errors.items())
        exc = errors[rank]
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised on rank {rank} of {world_size} in ops.spawn)")
        raise exc
    return results
