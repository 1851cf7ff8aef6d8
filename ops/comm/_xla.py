"""Collectives that a JAX program calls, with the rank as an operand.

[Note: one program for a group's ranks]
A collective inside a JAX program is an ordered ``io_callback`` into the
rank's communicator. Thread ranks run in one process, so a program whose
callbacks close over their rank's communicator, or whose slices start at
their rank's offset, is a different program on every rank. Here the rank is
an operand instead:

- a group's members (whatever each rank registers, usually the object that
  runs its collectives) are found by the group's family (the group and its
  siblings, the other colors of the split that made it) and the rank
  (:func:`register`, :func:`member`), and :func:`host_call` makes one
  callback per (family, host function, argument), the same object on every
  rank, that receives the rank as an operand;
- :class:`~ops.comm._programs.SharedJit` traces a function with a vector of ranks as an extra
  input; while it traces, :func:`ranks_operand` hands out elements of that
  vector for each group asked about, and records this rank's values of them.

So the ranks of a tensor-parallel or axis-bound loss trace one program.
:class:`~ops.comm._programs.SharedJit` compiles one executable per program
(``program_key`` in ``ops/comm/_programs.py``: the jaxpr's text, every
parameter that its text does not show (a callback's function, by identity),
its constants' bytes, its output tree, and where its inputs live:
``placement``), under a lock
per program, ahead of time, for every rank and object that traces it: a loss
whose function each rank makes anew (a closure in a notebook's per-rank
function, a new step object) compiles once, not once a rank. Nothing runs
under the lock, and no rank calls a jitted function that another is
compiling and running (jax's first call of a shared jitted function runs it
while later callers wait on its cache entry; a waiting rank would never join
the running one's collectives).

A program with effects (its collectives' callbacks) is shared too, and its
inputs are made ready before it runs: XLA runs a program whose inputs are
still being computed on a pool of its own threads, where ranks waiting in
collectives could leave no thread for the ranks they wait for. What no
program of the library's can rule out is XLA's CPU runtime running the
operations of one program concurrently (most models' programs, unlike a
chain of small operations) on its intra-op thread pool, one thread a core
unless the ``NPROC`` environment variable sets the count when JAX starts: a
rank waiting in a collective's callback holds one of those threads, and when
more thread ranks wait than the pool has threads, the ranks they wait for
never start, until the group's timeout (``ops.spawn``'s, 300 s by default)
fails them with a ``CollectiveTimeout`` that names the ranks behind and, as
it is raised on one of XLA's threads, ``NPROC``. Eight tensor-parallel
thread ranks at stage 3 (data 4, model 2) on two cores stalled so in 2 of 6
runs with an executable of their own per thread and in 2 of 6 with one
shared executable, and in none of 8 runs with ``NPROC=16`` (compiling once
instead of once a rank took the suite's tensor-parallel tests from 224 to
134 s). Thread ranks that call collectives inside XLA programs (tensor
parallelism, an axis-bound loss, ``pure_zero3``) beyond the cores want
``NPROC`` at least their number; processes (gloo, NCCL) run one rank each
and are not exposed to it.

A program that still differs between ranks (a rank read as a Python number
outside :func:`ranks_operand`) gets a key of its own, as before: sharing is
decided by equality of what runs, never assumed. Outside a :class:`SharedJit`
trace (eager dispatch, a user's own ``jax.jit``) the ranks are constants and
each rank's callbacks its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.stages

    from ops.comm._base import Communicator
    from ops.comm._threads import ThreadGroup

_T = TypeVar("_T")

__all__ = ["SLOTS", "Member", "host_call", "member", "rank_scope", "ranks_operand", "register"]

SLOTS = 8  # ranks a program can take as operands (two per group: data, model, pipe, replica)

_LOCK = threading.Lock()
_FAMILIES: weakref.WeakKeyDictionary[ThreadGroup | Communicator, int] = \
    weakref.WeakKeyDictionary()
_MEMBERS: dict[tuple[int, ...], dict[int, weakref.WeakSet[object]]] = {}
_NEXT = itertools.count(1)
_CALLBACKS: dict[tuple[Any, ...], Callable[..., object]] = {}  # by (family, fn, arg[, who])


@dataclasses.dataclass(frozen=True)
class Member:
    """A rank's place among the ranks whose programs can be one: ``family``
    names its group and the group's siblings (the other colors of the split
    that made it, whose programs are the same but for the rank), ``rank`` is
    its rank in its group and ``who`` its rank in the family's root group,
    unique in the family."""

    family: tuple[int, ...]
    rank: int
    who: int


def _place(comm: Communicator) -> tuple[ThreadGroup | Communicator, tuple[int, ...], int]:
    """(root, splits, rank in the root) of ``comm`` (see :class:`Member`): for
    thread ranks the split groups' lineage; a process's communicator is its
    own root (one rank a process)."""
    from ops.comm._threads import ThreadCommunicator, lineage

    if isinstance(comm, ThreadCommunicator):
        return lineage(comm.group, comm.rank)
    return comm, (), comm.rank


def register(comm: Communicator, obj: object) -> Member:
    """Make ``obj`` one of this rank's members of ``comm``'s family (held
    weakly: it lives as long as its owner keeps it; any live member of a rank
    runs its collectives, as all wrap the same group); returns the rank's
    place."""
    root, splits, who = _place(comm)
    with _LOCK:
        rid = _FAMILIES.get(root)
        if rid is None:
            rid = _FAMILIES[root] = next(_NEXT)
            live = set(_FAMILIES.values())
            for dead in [f for f in _MEMBERS if f[0] not in live]:
                del _MEMBERS[dead]
            for dead in [k for k in _CALLBACKS if k[0][0] not in live]:
                del _CALLBACKS[dead]
        family = (rid, *splits)
        _MEMBERS.setdefault(family, {}).setdefault(who, weakref.WeakSet()).add(obj)
    return Member(family, comm.rank, who)


def member(family: tuple[int, ...], who: int) -> Any:
    """An object that rank ``who`` (of the family's root) registered, alive."""
    try:
        return next(iter(_MEMBERS[family][who]))
    except (KeyError, StopIteration):
        raise RuntimeError(f"rank {who} of {family} has no registered member: the object that "
                           "ran its collectives is gone (keep the loss, or the TensorParallel "
                           "it uses, alive while its programs run)") from None


def host_call(place: Member, fn: Callable[..., object], arg: Hashable
              ) -> Callable[..., object]:
    """The callback ``(who, *xs) -> fn(member(family, who), arg, *xs)`` for the
    rank at ``place``. While a :class:`~ops.comm._programs.SharedJit` traces it is one object per
    ``(family, fn, arg)``, the same in every rank's program; otherwise one per
    rank as well: eager dispatch and a user's own ``jax.jit`` compile a
    program on its first call and run it while later callers of an equal
    program wait, and the ranks' collectives must not wait on each other so.
    ``fn`` lives as long as the process; ``arg`` is hashable."""
    key: tuple[object, ...] = (place.family, fn, arg)
    if _SCOPE.get() is None:
        key = (*key, place.who)
    with _LOCK:
        found = _CALLBACKS.get(key)
        if found is None:
            family = place.family

            def run(who: object, *xs: object) -> object:
                return fn(member(family, int(np.asarray(who))), arg, *xs)
            found = _CALLBACKS[key] = run
        return found


class _Scope:
    """The ranks operand of a program being traced, and this rank's values."""

    def __init__(self, ranks: jax.Array) -> None:
        self.ranks, self.values = ranks, np.zeros(SLOTS, np.int32)
        self.slots: dict[tuple[tuple[int, ...], str], int] = {}

    def value(self, key: tuple[tuple[int, ...], str], value: int) -> jax.Array | None:
        slot = self.slots.get(key)
        if slot is None:
            if len(self.slots) == SLOTS:
                return None
            slot = self.slots[key] = len(self.slots)
            self.values[slot] = value
        return self.ranks[slot]


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("zs_rank_scope",
                                                                       default=None)


def ranks_operand(place: Member) -> jax.Array:
    """``[rank, who]`` of the rank at ``place`` as a JAX int32 vector: elements
    of the ranks operand while a :class:`~ops.comm._programs.SharedJit` traces, else constants."""
    import jax.numpy as jnp

    scope = _SCOPE.get()
    if scope is not None:
        rank = scope.value((place.family, "rank"), place.rank)
        who = scope.value((place.family, "who"), place.who)
        if rank is not None and who is not None:
            return jnp.stack([rank, who])
    return jnp.asarray([place.rank, place.who], jnp.int32)


@contextlib.contextmanager
def rank_scope(ranks: jax.Array) -> Iterator[_Scope]:
    """Trace with ``ranks`` (an int32 vector of :data:`SLOTS`) as the ranks
    operand; the scope's ``values`` are then this rank's."""
    scope = _Scope(ranks)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


# -- one compile per program ---------------------------------------------------
