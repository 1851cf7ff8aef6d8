"""Pipeline parallelism composed with ZeRO: :func:`pipeline`.

[Note: pipeline]
``pipe = shard.pipeline(layered, comm=comm, stages=P, microbatches=M)`` lays
the world's ranks out as a (data x pipe) mesh: rank ``r`` runs stage
``r // D`` for data index ``r % D`` (``D = world / P``). ``pipe.data`` is this
rank's data-parallel communicator, ``pipe.params(params)`` the params of this
stage's layers (contiguous layers, balanced by parameter count or by the
``balance`` given; a dict keyed by layer index), and ``pipe`` itself is the
loss a ZeRO transform takes:

    step = shard.zero2(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
    state = step.init(pipe.params(params))
    state, metrics = step(state, batch)     # every stage of a data rank: its batch

Each step splits the batch into M micro-batches (by rows) and runs them
through the stages with the GPipe schedule (every forward, then every
backward) or 1F1B (``P - 1 - stage`` forwards to fill the pipe, then one
forward and one backward in turn, so at most P micro-batches' activations are
held). Activations and their gradients cross between stages by point-to-point
messages (a small header with the shape and dtype, then the data). A stage's
gradients are summed over the micro-batches and handed to the ZeRO step, which
shards and reduces them over the data axis as for any loss; the gradient norm
(for clipping and the finite check) and the loss are summed over the whole
mesh, so every rank clips by the same global norm and skips the same steps.
The trajectory is that of the unpipelined model on the whole batch.
``pipe.save(state, path)`` writes one checkpoint per stage and an index, which
``shard.load`` reads into an unpipelined step (and ``pipe.load`` a plain
checkpoint into a stage: a stage's leaves are named by layer index). With
``activation_checkpointing=True`` a stage keeps only each micro-batch's input
and recomputes its layers' forward in the backward (the same bits).

The layers are a ``shard.Layered`` (JAX) or the loss of
``interop.torch.layered`` (torch modules, see [Note: torch layers]). Either
runs a stage through the same runner protocol: ``forward(k, x, batch)`` and
``backward(k, ct)`` in the schedule's order, then ``finish(reducer)``; the
pipeline only moves the messages. Weights used by layers on different stages
are declared with ``tied=`` (see [Note: tied weights]).
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ops import Communicator
from ops.comm._collectives import from_comm, to_comm
from ops.device._device import device_of
from ops.device._dlpack import to_native
from shard.core._mesh import Mesh
from shard.core._protocol import LossProvider
from shard.core.losses._layered import Layered
from shard.monitor._profile import timed
from shard.pipelines._balance import _balanced, _size, balance_by_time
from shard.pipelines._jax_stage import JaxStage
from shard.pipelines._ties import TiedReducer, check_ties, resolve_ties

if TYPE_CHECKING:
    from collections.abc import Sequence

    import jax
    import torch
    from numpy.typing import ArrayLike

    from ops.comm._base import Pending
    from shard.core._protocol import GradSink
    from shard.core._state import TrainState
    from shard.step._runtime import Units
    from shard.step._step import ZeroStep

__all__ = ["Pipeline", "balance_by_time", "pipeline"]


class StageRunner(Protocol):
    """What runs a stage's layers (see [Note: pipeline]): a :class:`JaxStage`, or
    ``interop.torch.layered``'s stage (its loss's ``make_stage``)."""

    forward_passes: int

    def forward(self, k: int, x: np.ndarray | None, batch: Any) -> jax.Array | torch.Tensor:
        """Micro-batch ``k``'s output to send on (the loss on the last stage)."""

    def backward(self, k: int, ct: float | np.ndarray) -> object:
        """The input's gradient to send back (none on the first stage)."""

    def finish(self, reducer: GradSink) -> None:
        """Every layer's summed gradients to ``reducer``."""

_DTYPES = ("float32", "bfloat16", "float16", "float64")
_HEADER, _DATA = 0, 1  # tags: a message's header, then its payload
_MAX_DIMS = 8


def pipeline(loss: LossProvider, *, comm: Communicator | None = None,
             stages: int | None = None, microbatches: int = 1, schedule: str = "1f1b",
             balance: list[int] | None = None, activation_checkpointing: bool = False,
             tied: Sequence[Sequence[tuple[int, str]]] | None = None,
             mesh: Mesh | None = None) -> Pipeline:
    """Split a :class:`shard.Layered` loss into ``stages`` pipeline stages over
    ``comm``'s ranks (see [Note: pipeline]).

    Args:
      loss: the layers (one ZeRO unit each): a :class:`shard.Layered`, or the
        loss object of ``interop.torch.layered(modules, loss=...)`` (see
        [Note: torch layers] in ``interop/torch/_layers.py``).
      comm: the world's communicator (every rank calls this: it splits it).
      stages: P, which must divide the world size.
      mesh: instead of ``comm`` and ``stages``, a :class:`shard.Mesh` with axes
        ``pipe`` (the stages) and ``data`` (each stage's ZeRO ranks), in either
        order: its communicators are the pipeline's.
      microbatches: M; every stage's batch rows must divide by it.
      schedule: ``"1f1b"`` or ``"gpipe"``.
      balance: layers per stage (summing to the number of layers), e.g. from
        :func:`balance_by_time`; default: contiguous runs of about equal
        parameter count, once ``params`` are seen (``pipe.params(params)``).
      activation_checkpointing: keep only each micro-batch's input to the stage
        and recompute the stage's forward in its backward (less activation
        memory, about one more forward of compute).
      tied: groups of ``(layer, key)`` pairs naming one weight used by several
        layers, e.g. ``[[(0, "wte"), (11, "w_out")]]`` (see [Note: tied
        weights] in ``shard/pipelines/_ties.py``).
    """
    if mesh is not None:
        if comm is not None or stages is not None:
            raise ValueError("pipeline: give mesh=, or comm= and stages=, not both")
        if sorted(mesh.axis_names) not in (["data", "pipe"], ["data", "model", "pipe"]):
            raise ValueError(f"pipeline: mesh must have the axes 'pipe' and 'data', and "
                             f"'model' for tensor parallelism; got {list(mesh.axis_names)}")
        comm, stages = mesh.comm, mesh.shape["pipe"]
    elif comm is None or stages is None:
        raise TypeError("pipeline: give comm= and stages=, or mesh=shard.Mesh(comm, "
                        "{'pipe': P, 'data': D})")
    if not isinstance(loss, Layered) and not (isinstance(loss, LossProvider)
                                              and loss.make_stage is not None):
        raise TypeError(f"pipeline: loss must be a shard.Layered or the loss of "
                        f"interop.torch.layered(...); got {type(loss).__name__}")
    if not isinstance(stages, int) or stages < 1 or comm.world_size % stages:
        raise ValueError(f"pipeline: stages must divide the world size {comm.world_size}; got "
                         f"{stages!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be an int >= 1; got {microbatches!r}")
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"pipeline: schedule must be '1f1b' or 'gpipe'; got {schedule!r}")
    n = len(loss.layers)
    if stages > n:
        raise ValueError(f"pipeline: {stages} stages for {n} layers")
    if balance is not None and (len(balance) != stages or sum(balance) != n
                                or min(balance) < 1):
        raise ValueError(f"pipeline: balance must give each of the {stages} stages at least "
                         f"one layer, {n} in all; got {balance}")
    if mesh is not None:
        stage, data, pipe = mesh.coords["pipe"], mesh["data"], mesh["pipe"]
    else:
        width = comm.world_size // stages
        stage = comm.rank // width
        data = comm.split(stage)  # the ranks of this stage
        pipe = comm.split(comm.rank % width)  # this data index's stages, in stage order
    return Pipeline(loss, stage, stages, microbatches, schedule, balance, data, pipe, comm,
                    bool(activation_checkpointing), check_ties(tied, n))


@dataclass
class Pipeline(LossProvider):
    """This rank's pipeline stage: the loss object a ZeRO transform takes."""

    loss: LossProvider  # a Layered, or interop.torch.layered's loss
    stage: int
    stages: int
    microbatches: int
    schedule: str
    balance: list[int] | None
    data: Communicator
    pipe: Communicator
    world: Communicator
    activation_checkpointing: bool = False
    tied: list[list[tuple[int, str]]] = field(default_factory=list)  # see [Note: tied weights]
    forward_passes: int = 0  # layer forwards run, recomputations included

    def __post_init__(self) -> None:
        # the layers' split by interop.torch.parallelize (their params are
        # slices already), if any
        self.tensor_parallel = self.loss.tensor_parallel

    # -- layout ---------------------------------------------------------------
    def layers_of(self, params: list[object]) -> range:
        """The layers (indices) of this stage."""
        if len(params) != len(self.loss.layers):
            raise ValueError(f"pipeline: {len(self.loss.layers)} layers but {len(params)} "
                             "entries in params (one per layer)")
        counts = self.balance or _balanced([_size(p) for p in params], self.stages)
        start = sum(counts[:self.stage])
        return range(start, start + counts[self.stage])

    def params(self, params: list[object]) -> dict[int, Any]:
        """This stage's part of the full params (a list with one entry per layer),
        keyed by layer index: checkpoints and ``shard.gather`` name the layers
        as the whole model does, so one stage's state is never mistaken for
        another's layers."""
        params = list(params)
        self._layers = self.layers_of(params)
        self._ties = resolve_ties(self.tied, params, self._layers)
        self.norm_skip = tuple(i for tie in self._ties for i in tie.skip)
        return {i: params[i] for i in self._layers}

    # -- checkpoints --------------------------------------------------------------
    def save(self, state: TrainState, path: str | os.PathLike, *, extra: object = None) -> Path:
        """Save every stage's state under ``path`` (a collective over the whole
        mesh): one checkpoint per stage in ``stage-<s>/``, then ``pipeline.json``.
        ``shard.load`` reads it into a plain step or a pipeline of any shape."""
        from shard.checkpoint._checkpoint import save

        path = Path(path)
        save(state, path / f"stage-{self.stage:03d}", comm=self.data, extra=extra)
        self.world.barrier()
        if self.world.rank == 0:
            part = path / "pipeline.json.part"
            part.write_text(json.dumps({"step": int(state.step), "parts": [
                f"stage-{s:03d}" for s in range(self.stages)]}))
            os.replace(part, path / "pipeline.json")
        self.world.barrier()
        return path

    def load(self, path: str | os.PathLike, step: ZeroStep) -> tuple[TrainState, object]:
        """This stage's state from a checkpoint of the whole model, plain or
        pipelined (a collective over the stage's data ranks)."""
        from shard.checkpoint._load import load

        return load(path, step, comm=self.data)

    def claim(self, comm: Communicator) -> None:
        """A torch stage's modules serve one rank of the whole mesh (see
        ``interop.torch.layered``)."""
        self.loss.claim(self.world)

    def configured(self, *, has_aux: bool,
                   cast_forward_inputs: bool) -> AbstractContextManager[object]:
        """The stage's loss as the step asks (a torch stage casts its first
        input as ``Precision`` says)."""
        return self.loss.configured(has_aux=has_aux, cast_forward_inputs=cast_forward_inputs)

    @property
    def jax_batch(self) -> bool:
        """Whether the batch feeds JAX layers (so the step casts it under
        ``Precision``, as for an unpipelined ``Layered``)."""
        return isinstance(self.loss, Layered)

    @property
    def norm_comm(self) -> Communicator:
        """The gradient norm and the loss sum over the whole mesh."""
        return self.world

    @property
    def data_axis(self) -> Communicator:
        """The stage's data ranks, over which its ZeRO step shards."""
        return self.data

    # -- the step -------------------------------------------------------------
    def run_units(self, units: Units, reducer: GradSink, batch: object, scale: float) -> float:
        """One step's schedule over every micro-batch (see the Note); returns this
        stage's share of the loss (the mean over micro-batches on the last stage,
        0 elsewhere)."""
        runner = self._runner(units, self.activation_checkpointing)
        m, first, last = self.microbatches, self.stage == 0, self.stage == self.stages - 1
        micro, rows = _split(batch, m)
        self._begin(backward=True, rows=rows)
        losses: list[jax.Array | torch.Tensor] = []
        sends: list[_Sends] = []
        for kind, k in _order(self.schedule, self.stages, self.stage, m):
            if kind == "F":
                out = runner.forward(k, None if first else self._recv(self.stage - 1), micro[k])
                if last:
                    losses.append(out)
                else:
                    sends.append(self._send(out, self.stage + 1))
            else:
                ct = runner.backward(k, scale / m if last else self._recv(self.stage + 1))
                if not first:
                    sends.append(self._send(ct, self.stage - 1))
        for work in sends:
            work.wait()
        if self._ties:  # see [Note: tied weights]
            tied = TiedReducer(self._ties, self.pipe)
            runner.finish(tied)
            tied.flush(reducer)
        else:
            runner.finish(reducer)
        self.forward_passes += runner.forward_passes
        return sum(float(x) for x in losses) / m if last else 0.0

    def loss_units(self, units: Units, batch: object) -> float:
        """Every micro-batch's forward through the stages, no gradients (for
        ``step.evaluate``); the mean loss on the last stage, 0 elsewhere."""
        m, first, last = self.microbatches, self.stage == 0, self.stage == self.stages - 1
        micro, rows = _split(batch, m)
        self._begin(backward=False, rows=rows)
        losses, sends = [], []
        with self.loss.evaluating():
            runner = self._runner(units, True)  # keeps only each micro-batch's input
            for k in range(m):
                out = runner.forward(k, None if first else self._recv(self.stage - 1), micro[k])
                if last:
                    losses.append(out)
                else:
                    sends.append(self._send(out, self.stage + 1))
            for work in sends:
                work.wait()
        return sum(float(x) for x in losses) / m if last else 0.0

    def _runner(self, units: Units, checkpointing: bool) -> StageRunner:
        layers = getattr(self, "_layers", None)
        if layers is None:
            raise RuntimeError("pipeline: call step.init(pipe.params(params)) first")
        make = self.loss.make_stage
        if make is not None:
            return make(units, layers, checkpointing=checkpointing)
        if not isinstance(self.loss, Layered):  # pipeline() takes it, or one with make_stage
            raise TypeError(f"pipeline: loss must be a shard.Layered or the loss of "
                            f"interop.torch.layered(...); got {type(self.loss).__name__}")
        return JaxStage(self.loss, units, layers, checkpointing)

    # -- messages ---------------------------------------------------------------
    # A step's messages to one peer all have one shape (equal micro-batches through
    # the same layers), so only the first of each step carries a header, as
    # torch's pipelining infers shapes once; a later one that differs is refused.
    # The header also carries the sender's micro-batch rows: every stage of a data
    # rank must be given the same batch, and the receiver refuses one that is not.
    # Messages are host arrays (what a JAX or torch CPU stage computes); a backend
    # that moves device memory only (NCCL) gets them copied to its device and back
    # (to_comm, from_comm), into buffers of its own memory (allocate).
    def _send(self, x: object, dst: int) -> _Sends:
        a = _host_array(x)
        if a.ndim > _MAX_DIMS or str(a.dtype) not in _DTYPES:
            raise TypeError(f"pipeline: stage {self.stage} passes a {a.dtype} array of "
                            f"{a.ndim} dimensions; stages pass float arrays of up to "
                            f"{_MAX_DIMS} dimensions")
        kind = (a.shape, str(a.dtype))
        works = []
        if dst not in self._sent:
            self._sent[dst] = kind
            header = np.zeros(3 + _MAX_DIMS, np.int64)
            header[:3] = a.ndim, _DTYPES.index(str(a.dtype)), self._rows
            header[3:3 + a.ndim] = a.shape
            works.append(self.pipe.isend(to_comm(self.pipe, header), dst, tag=_HEADER))
        elif self._sent[dst] != kind:
            raise ValueError(f"pipeline: stage {self.stage} sends stage {dst} a "
                             f"{kind[1]}{list(kind[0])} after a {self._sent[dst][1]}"
                             f"{list(self._sent[dst][0])} in the same step; every "
                             "micro-batch's message to a stage must have one shape")
        works.append(self.pipe.isend(to_comm(self.pipe, a.reshape(-1)), dst, tag=_DATA))
        return _Sends(works)

    def _recv(self, src: int) -> np.ndarray:
        import jax.numpy as jnp

        with timed("pipeline_wait"):  # the bubble: waiting on a neighbour
            if src not in self._received:
                header = from_comm(self.pipe, self.pipe.recv_(
                    self.pipe.allocate(3 + _MAX_DIMS, np.int64), src, tag=_HEADER))
                ndim, code, rows = (int(v) for v in header[:3])
                if rows != self._rows:
                    raise ValueError(f"pipeline: stage {self.stage}'s micro-batches have "
                                     f"{self._rows} rows but stage {src}'s have {rows}: every "
                                     "stage of a data rank must be given the same batch")
                self._received[src] = (tuple(int(d) for d in header[3:3 + ndim]),
                                       np.dtype(jnp.dtype(_DTYPES[code])))
            shape, dtype = self._received[src]
            posted = self._posted.pop(src, None)
            n = int(np.prod(shape, dtype=np.int64))
            out = posted.wait() if posted is not None else self.pipe.recv_(
                self.pipe.allocate(n, dtype), src, tag=_DATA)
            self._expected[src] -= 1
            if self._expected[src] > 0:  # the next one's size is this one's: post it now
                self._posted[src] = self.pipe._prepost_recv(self.pipe.allocate(n, dtype), src,
                                                             _DATA)
        return from_comm(self.pipe, out).reshape(shape)

    def _begin(self, backward: bool, rows: int) -> None:
        """A step's (or an evaluation's) message state: the shapes seen so far,
        how many messages each neighbour will send, and this stage's micro-batch
        rows."""
        m = self.microbatches
        self._rows = rows
        self._sent: dict[int, tuple[tuple[int, ...], str]] = {}  # (shape, dtype)
        self._received: dict[int, tuple[tuple[int, ...], np.dtype]] = {}
        self._posted: dict[int, Pending] = {}
        self._expected = {self.stage - 1: m, self.stage + 1: m if backward else 0}


def _host_array(x: object) -> np.ndarray:
    """A message's payload in host memory (device activations are copied out)."""
    if not isinstance(x, np.ndarray):
        x = to_native(x)[0]
        device = device_of(x)
        if not device.host:
            x = device.to_host_into(x, np.empty(x.shape, x.dtype))
    return np.ascontiguousarray(x)


class _Sends:
    def __init__(self, works: list[Pending]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _order(schedule: str, p: int, s: int, m: int) -> list[tuple[str, int]]:
    """Stage ``s``'s forwards (F) and backwards (B) of ``m`` micro-batches."""
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    warm = min(p - 1 - s, m)
    out = [("F", k) for k in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", k) for k in range(m - warm, m)]


def _split(batch: object, m: int) -> tuple[list[object], int]:
    """The batch cut into ``m`` micro-batches by rows, and their rows."""
    import jax

    def rows(x: ArrayLike) -> int:
        return int(np.shape(x)[0])

    leaves = jax.tree_util.tree_leaves(batch)
    n = {rows(x) for x in leaves}
    if len(n) != 1 or next(iter(n)) % m:
        raise ValueError(f"pipeline: the batch's leading dimensions {sorted(n)} must agree "
                         f"and divide into {m} micro-batches")
    k = next(iter(n)) // m
    return [jax.tree_util.tree_map(lambda x, i=i: x[i * k:(i + 1) * k], batch)
            for i in range(m)], k
