"""The stand-in device's counters (see :mod:`ops.testing`): host reads, and
every device operation by kind, per thread."""

from __future__ import annotations

import threading

from ops.comm._base import collectives_issued, in_collective

__all__ = ["DEVICE_OPS", "SYNCS"]


class _Syncs:
    """Counts device-to-host reads, per thread (thread ranks count their own)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def count(self) -> int:
        return getattr(self._local, "n", 0)

    def add(self) -> None:
        self._local.n = self.count + 1
        DEVICE_OPS.add("host_read")

    def reset(self) -> None:
        self._local.n = 0


SYNCS = _Syncs()


class _DeviceOps:
    """Counts the stand-in's device operations by kind, per thread (thread ranks
    count their own), outside collectives (see the module docstring)."""

    KINDS = ("alloc", "copy", "kernel", "host_read", "dlpack")

    def __init__(self) -> None:
        self._local = threading.local()

    def _counts(self) -> dict[str, int]:
        counts = getattr(self._local, "counts", None)
        if counts is None:
            counts = self._local.counts = dict.fromkeys(self.KINDS, 0)
        return counts

    def add(self, kind: str, n: int = 1) -> None:
        if not in_collective():
            self._counts()[kind] += n

    def snapshot(self) -> dict[str, int]:
        """This thread's counts since its last reset, by kind, and the collectives
        it issued."""
        since = getattr(self._local, "collectives", 0)
        return {**self._counts(), "collective": collectives_issued() - since}

    def reset(self) -> None:
        self._local.counts = dict.fromkeys(self.KINDS, 0)
        self._local.collectives = collectives_issued()


DEVICE_OPS = _DeviceOps()
