"""One compile of a JAX program for every rank and object that traces it
(see [Note: one program for a group's ranks] in ``ops/comm/_xla.py``): a
program's key (:func:`program_key`, :func:`placement`), the compiled programs
kept by key (:func:`compiled`), and :class:`SharedJit`, ``jax.jit`` whose
executables the ranks share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ops.comm._xla import SLOTS, rank_scope

if TYPE_CHECKING:
    import jax
    import jax.stages
    from jax.extend.core import ClosedJaxpr, Jaxpr

_T = TypeVar("_T")

__all__ = ["SharedJit", "compiled", "placement", "program_key", "ready"]

KEEP = 64  # compiled programs kept, the most recently used
_LOCK = threading.Lock()

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
