"""Collectives that a JAX program calls, and one compiled program for many ranks.

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
- :class:`SharedJit` traces a function with a vector of ranks as an extra
  input; while it traces, :func:`ranks_operand` hands out elements of that
  vector for each group asked about, and records this rank's values of them.

So the ranks of a tensor-parallel or axis-bound loss trace one program.
:class:`SharedJit` compiles one executable per program (:func:`program_key`:
the jaxpr's text, every parameter that its text does not show (a callback's
function, by identity), its constants' bytes, its output tree, and where its
inputs live: :func:`placement`), under a lock
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
import hashlib
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.stages
    from jax.extend.core import ClosedJaxpr, Jaxpr

    from ops.comm._base import Communicator
    from ops.comm._threads import ThreadGroup

_T = TypeVar("_T")

__all__ = ["SLOTS", "Member", "SharedJit", "compiled", "host_call", "member", "placement",
           "program_key", "rank_scope", "ranks_operand", "ready", "register"]

SLOTS = 8  # ranks a program can take as operands (two per group: data, model, pipe, replica)
KEEP = 64  # compiled programs kept, the most recently used

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
    rank at ``place``. While a :class:`SharedJit` traces it is one object per
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
    of the ranks operand while a :class:`SharedJit` traces, else constants."""
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
_RULES = {"custom_jvp_call": ("jvp_jaxpr_fun", "jvp_jaxpr_thunk"),
          "custom_vjp_call": ("fwd_jaxpr_thunk", "bwd", "out_trees")}
# what JAX would differentiate with, not what it lowers: the call's jaxpr is
# its program, and the rules are made anew on every trace


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _array_key(x: object) -> str:
    a = np.asarray(x)
    if a.dtype.kind == "V" or a.dtype == object:  # a key array's data, an opaque dtype
        raise TypeError
    return f"array({a.shape}, {a.dtype}, {_digest(np.ascontiguousarray(a).tobytes())})"


def _canon(v: Any, keep: list[object]) -> str:  # Any: read by hasattr, as JAX's params are
    """``v`` as text that two equal parameters share and two different ones do
    not; an object known by its identity only is kept alive in ``keep`` so
    that its id is not reused while the key is."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, np.dtype,
                                   np.generic)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__}[{', '.join(_canon(x, keep) for x in v)}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_canon(x, keep)}" for k, x in v.items()) + "}"
    if hasattr(v, "eqns"):
        return _jaxpr_key(v, keep)
    if hasattr(v, "jaxpr") and hasattr(v, "consts"):
        return f"closed({_jaxpr_key(v.jaxpr, keep)}; {_consts_key(v.consts, keep)})"
    if hasattr(v, "__array__") and hasattr(v, "dtype") and hasattr(v, "shape"):
        try:
            return _array_key(v)
        except TypeError:
            pass
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return f"{type(v).__qualname__}(" + ", ".join(
            f"{f.name}={_canon(getattr(v, f.name), keep)}" for f in dataclasses.fields(v)) + ")"
    text = repr(v)
    if type(v).__eq__ is object.__eq__ or " at 0x" in text or "object at" in text:
        keep.append(v)
        return f"id:{type(v).__qualname__}:{id(v)}"
    return f"{type(v).__qualname__}:{text}"


def _consts_key(consts: Iterable[object], keep: list[object]) -> str:
    return "[" + ", ".join(_canon(c, keep) for c in consts) + "]"


def _jaxpr_key(jaxpr: Jaxpr, keep: list[object]) -> str:
    parts = []
    for eqn in jaxpr.eqns:
        skip = _RULES.get(eqn.primitive.name, ())
        parts.append(eqn.primitive.name + "(" + ", ".join(
            f"{k}={_canon(v, keep)}" for k, v in sorted(eqn.params.items())
            if k not in skip) + ")")
    return "; ".join(parts)


def program_key(closed: ClosedJaxpr, out_tree: object = None) -> tuple[str, list[object]]:
    """A traced program's key (see the Note) and the objects it names by
    identity, to be kept alive beside it."""
    keep: list[object] = []
    text = str(closed.jaxpr)
    params = _jaxpr_key(closed.jaxpr, keep)
    consts = _consts_key(closed.consts, keep)
    return _digest("\n".join((text, params, consts, repr(out_tree))).encode()), keep


class _Compiled:
    """A program compiled once: the executable and what its key names."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executable: jax.stages.Compiled | None = None
        self.keep: list[object] = []


_PROGRAMS: OrderedDict[str, _Compiled] = OrderedDict()


def compiled(key: str, keep: list[object], compile_fn: Callable[[], jax.stages.Compiled]
             ) -> jax.stages.Compiled:
    """The executable of the program ``key``, compiled by ``compile_fn`` by the
    first caller; later callers wait for it (nothing runs under its lock)."""
    with _LOCK:
        entry = _PROGRAMS.get(key)
        if entry is None:
            entry = _PROGRAMS[key] = _Compiled()
            while len(_PROGRAMS) > KEEP:
                _PROGRAMS.popitem(last=False)
        else:
            _PROGRAMS.move_to_end(key)
    with entry.lock:
        if entry.executable is None:
            entry.executable, entry.keep = compile_fn(), keep
        return entry.executable


def placement(leaves: Iterable[object]) -> str:
    """Where a program's inputs live, for its key: each JAX array's sharding,
    and for the other leaves JAX's default device (where a call puts them).
    The same jaxpr compiled for the CPU refuses inputs on a GPU, and the
    other way round."""
    import jax

    default = getattr(jax.config, "jax_default_device", None)  # the context's, if set
    if not isinstance(default, jax.Device):  # None, or a platform's name
        default = jax.devices(default)[0]
    here = jax.sharding.SingleDeviceSharding(default)
    return repr(tuple(x.sharding if isinstance(x, jax.Array) else here for x in leaves))


def _signature(args: tuple[object, ...]) -> tuple[object, ...]:
    import jax

    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, *((x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)
                    if isinstance(x, jax.Array) else
                    (np.shape(x), np.result_type(x)) if isinstance(x, np.ndarray) else
                    (type(x),) for x in leaves))


class SharedJit:
    """``jax.jit(fn)`` whose executables are shared by every rank and object
    that traces the same program (see [Note: one program for a group's ranks]).

    ``fn``'s arguments are positional; a call with a new signature (tree,
    shapes, dtypes, placement) traces ``fn`` with the ranks operand bound,
    finds or compiles the program, and keeps this object's ranks for it.
    """

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn
        self._local: dict[object, tuple[jax.stages.Compiled, jax.Array, bool, int]] = {}
        self._lock = threading.Lock()

    def _ranked(self, ranks: jax.Array, *args: object) -> object:
        with rank_scope(ranks) as scope:
            out = self.fn(*args)
        self._values = scope.values
        return out

    def trace(self, *args: object) -> tuple[jax.stages.Traced, np.ndarray]:
        """The ``jax.stages.Traced`` of ``fn`` at ``args``, the ranks operand its
        first input, with this object's values of it."""
        import jax

        ranks = jax.ShapeDtypeStruct((SLOTS,), np.int32)
        with self._lock:
            traced = jax.jit(self._ranked).trace(ranks, *args)
            return traced, self._values

    def prepare(self, *args: object) -> tuple[jax.stages.Compiled, jax.Array, bool, int]:
        """The executable for ``args``'s signature, this object's ranks,
        whether the program has effects (callbacks: collectives) and the
        thread that traced it; traced and compiled on first use (nothing
        runs). A program with effects is traced again on another thread,
        whose ranks (an object that thread ranks share, such as a loss
        defined once) may differ; the executable is the same."""
        import jax

        sig = _signature(args)
        hit = self._local.get(sig)
        thread = threading.get_ident()
        if hit is not None and hit[2] and hit[3] != thread:
            hit = self._local.get((sig, thread))
        if hit is None:
            traced, values = self.trace(*args)
            effects = bool(traced.jaxpr.effects)
            key, keep = program_key(traced.jaxpr, traced.out_tree)
            key = f"{key} on {placement(jax.tree_util.tree_leaves(args))}"
            hit = (compiled(key, keep, lambda: traced.lower().compile()),
                   jax.block_until_ready(jax.device_put(values)), effects, thread)
            self._local.setdefault(sig, hit)
            if effects:
                self._local[(sig, thread)] = hit
        return hit

    def __call__(self, *args: object) -> Any:
        executable, ranks, effects, _ = self.prepare(*args)
        if effects:
            ready(args)
        return executable(ranks, *args)


def ready(args: _T) -> _T:
    """``args`` once every array in them is computed. A program whose
    callbacks wait on other ranks must start with its inputs ready: XLA runs
    one whose inputs are still being computed on a small pool of its own
    threads, where ranks waiting in collectives can leave no thread for the
    ranks they wait for."""
    import jax

    return jax.block_until_ready(args)
