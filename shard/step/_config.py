"""A ZeRO step's configuration: :class:`StepConfig`, checked once and frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ops import Communicator, FusedOptimizer
from shard.core._data_rank import check_key
from shard.core._loss import JaxLoss
from shard.core._optim import is_transformation
from shard.core._policy import LossScale, Precision
from shard.core._protocol import LossProvider, Provided, classify
from shard.offload._offload import Offload
from shard.offload._step import check_offload

__all__ = ["StepConfig"]


@dataclass(frozen=True, eq=False)
class StepConfig:
    """What a :class:`~shard.ZeroStep` is built with: ``shard.zero3(...)``'s
    arguments, checked. Nothing a step learns later lives here; the layouts,
    dtypes and device come from the params, in a
    :class:`~shard.step._plan.Plan` that every state carries."""

    name: str
    stage: int
    loss_fn: LossProvider  # JaxLoss for a JAX function, Provided for a bare object
    kind: str  # "jax", "layered" or "provider" (see classify)
    optimizer: Any  # a FusedOptimizer, or an optax GradientTransformation
    comm: Communicator
    specs: Any
    units: Any
    precision: Precision
    clip_norm: float | None
    loss_scale: LossScale | None
    prefetch: int
    loggers: tuple
    offload: Offload | None
    gradient_accumulation_steps: int | None
    has_aux: bool
    weight_by_rows: bool
    replicate: Communicator | None = None  # HSDP: the ranks that hold this rank's shard too
    tensor_parallel: Any = None  # a shard.TensorParallel: the model ranks of this data rank
    reshard_after_forward: bool | int = True
    # hpZ: (this node's ranks, the ranks of this one's place on every node), or None
    secondary: tuple[Communicator, Communicator] | None = None
    trainable: Any = None  # which leaves train (see [Note: frozen leaves]); None: all
    gradient_divide_factor: float | None = None  # None: the data ranks (a mean)
    key: tuple | None = None  # (raw data, impl or None): see [Note: per-rank keys]

    @property
    def ranks(self) -> int:
        """Data-parallel ranks in all: ``comm``'s, times the replicas'."""
        return self.comm.world_size * (self.replicate.world_size if self.replicate else 1)

    @classmethod
    def make(cls, loss_fn: Any, *, stage: int, optimizer: Any, comm: Communicator,
             specs: Any = None, units: Any = None, precision: Precision | None = None,
             clip_norm: float | None = None, loss_scale: LossScale | None = None,
             prefetch: int = 1, loggers: Any = (), offload: Offload | None = None,
             gradient_accumulation_steps: int | None = None,
             has_aux: bool = False, weight_by_rows: bool = False,
             replicate: Communicator | None = None, tensor_parallel: Any = None,
             reshard_after_forward: bool | int = True, trainable: Any = None,
             gradient_divide_factor: float | None = None, key: Any = None) -> StepConfig:
        """The configuration of ``zero{stage}(loss_fn, ...)``; a TypeError or
        ValueError naming the argument for anything it cannot train with."""
        name = f"zero{stage}"
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3; got {stage!r}")
        if not (isinstance(optimizer, FusedOptimizer) or is_transformation(optimizer)):
            raise TypeError(f"{name}: optimizer must be ops.adamw(...), ops.adam(...), "
                            "ops.lion(...) or ops.lamb(...), or an optax GradientTransformation; "
                            "got "
                            f"{type(optimizer).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"{name}: comm must be an ops.Communicator (from ops.spawn or "
                            f"ops.init_from_env); got {type(comm).__name__}")
        kind = classify(loss_fn)
        # what the step reads of the loss (see [Note: the loss protocol]): a loss
        # object's own answers, a JAX function's for a function
        reads = loss_fn if isinstance(loss_fn, LossProvider) else (
            Provided(loss_fn) if kind == "provider" else LossProvider())
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"{name}: clip_norm must be > 0; got {clip_norm!r}")
        if prefetch < 0:
            raise ValueError(f"{name}: prefetch must be >= 0; got {prefetch}")
        check_offload(name, stage, offload, clip_norm)
        if replicate is not None:  # see [Note: replicas]
            if not isinstance(replicate, Communicator):
                raise TypeError(f"{name}: replicate must be an ops.Communicator (such as "
                                f"shard.Mesh(comm, {{'replicate': R, 'shard': S}})['replicate']); "
                                f"got {type(replicate).__name__}")
            if stage == 0:
                raise ValueError(f"{name}: zero0 keeps everything whole on every rank: give "
                                 "it the whole communicator instead of replicate=")
            if reads.norm_comm is not None:
                raise ValueError(f"{name}: a pipeline's stages have their own data axis; "
                                 "replicate= is for a step over one communicator")
            if offload is not None and offload.overlap:
                raise ValueError(f"{name}: Offload(overlap=True) updates each unit during "
                                 "the backward, before the replicas' gradients are summed; "
                                 "drop one of them")
        if tensor_parallel is not None:  # see [Note: tensor parallelism with ZeRO]
            if not (hasattr(tensor_parallel, "shard") and isinstance(
                    getattr(tensor_parallel, "comm", None), Communicator)):
                raise TypeError(f"{name}: tensor_parallel must be a shard.TensorParallel over "
                                f"a mesh or a communicator; got {tensor_parallel!r}")
            for what, bad in (("replicate=", replicate is not None),
                              ("offload=", offload is not None)):
                if bad:
                    raise NotImplementedError(f"{name}: tensor_parallel= does not compose "
                                              f"with {what}; drop one of them")
        split = reads.tensor_parallel  # interop.torch.parallelize's module
        if split is not None and split is not tensor_parallel:
            raise ValueError(f"{name}: the loss's module was split by interop.torch.parallelize: "
                             "pass the TensorParallel it returned as tensor_parallel=")
        data = reads.data_axis  # a pipeline stage: ZeRO runs on its data axis
        if data is not None and comm is not data and comm.world_size != data.world_size:
            raise ValueError(f"{name}: a pipeline's step runs on its data axis: pass "
                             f"comm=pipe.data ({data.world_size} rank(s)); got a communicator "
                             f"of {comm.world_size} ranks")
        secondary = _secondary(name, stage, comm, reshard_after_forward, replicate=replicate,
                               tensor_parallel=tensor_parallel, loss_fn=reads)
        f = gradient_divide_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                              or not f > 0 or f != f or f == float("inf")):
            raise ValueError(f"{name}: gradient_divide_factor must be a finite number > 0; "
                             f"got {f!r}")
        if f is not None and weight_by_rows:
            raise ValueError(f"{name}: weight_by_rows divides by the rows of every rank; drop "
                             "gradient_divide_factor= or weight_by_rows=")
        n = gradient_accumulation_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"{name}: gradient_accumulation_steps must be an int >= 1; got {n!r}")
        loggers = (loggers,) if callable(loggers) else tuple(loggers or ())
        for lg in loggers:
            if not callable(lg):
                raise TypeError(f"{name}: loggers must be callables (step, metrics), such as "
                                f"shard.CSVLogger; got {type(lg).__name__}")
        if not isinstance(weight_by_rows, bool):
            raise TypeError(f"{name}: weight_by_rows must be True or False; got "
                            f"{weight_by_rows!r}")
        if weight_by_rows and reads.norm_comm is not None:
            raise ValueError(f"{name}: weight_by_rows is for data-parallel ranks; a pipeline's "
                             "stages see the same micro-batches (give its data ranks equal "
                             "rows)")
        if weight_by_rows and offload is not None and offload.overlap:
            raise ValueError(f"{name}: weight_by_rows needs every rank's rows before any update, "
                             "and Offload(overlap=True) updates during the backward; drop one "
                             "of them")
        if not isinstance(has_aux, bool):
            raise TypeError(f"{name}: has_aux must be True or False; got {has_aux!r}")
        if has_aux and kind != "jax" and not reads.supports_aux:
            raise TypeError(f"{name}: has_aux=True is for a JAX loss function or "
                            "interop.torch.functional's loss; this "
                            f"{type(loss_fn).__name__} returns its loss alone")
        if reads.supports_aux:  # the loss object splits (loss, aux)
            reads.set_has_aux(has_aux)
        if units is None:  # a loss object may know its model's units (interop.torch does)
            units = reads.units if kind == "provider" else None
        if key is not None:  # see [Note: per-rank keys]
            if kind != "jax":
                raise NotImplementedError(f"{name}: key= gives a JAX loss function its "
                                          "random keys; this "
                                          f"{type(loss_fn).__name__} draws its own")
            key = check_key(name, key)
        loss = JaxLoss.shared(loss_fn, has_aux) if kind == "jax" else reads
        return cls(name, stage, loss, kind, optimizer, comm, specs, units,
                   precision or Precision(), clip_norm, loss_scale, prefetch, loggers, offload,
                   gradient_accumulation_steps, has_aux, weight_by_rows, replicate,
                   tensor_parallel, reshard_after_forward, secondary, trainable,
                   None if f is None else float(f), key)


def _secondary(name: str, stage: int, comm: Communicator, reshard: Any, *, replicate: Any,
               tensor_parallel: Any, loss_fn: LossProvider
               ) -> tuple[Communicator, Communicator] | None:
    """``reshard_after_forward``'s communicators (see [Note: secondary shards]):
    None for True (or an int equal to the world size), else the mesh of
    ``nodes x reshard_after_forward`` ranks' two axes, made here by every rank."""
    w = comm.world_size
    if reshard is True:
        return None
    if not isinstance(reshard, (bool, int)):
        raise TypeError(f"{name}: reshard_after_forward must be True, False or an int (the "
                        f"ranks per node); got {type(reshard).__name__}")
    size = 1 if reshard is False else int(reshard)
    if stage != 3:
        raise ValueError(f"{name}: reshard_after_forward is stage 3's (zero3): stages 0-2 keep "
                         "the whole params between steps")
    if not 1 <= size <= w or w % size:
        raise ValueError(f"{name}: reshard_after_forward={reshard!r} must divide the world size "
                         f"{w} (the ranks per node, typically torchrun's --nproc-per-node)")
    if size == w:
        return None
    for what, bad in (("replicate=", replicate is not None),
                      ("tensor_parallel=", tensor_parallel is not None),
                      ("a pipeline", loss_fn.norm_comm is not None)):
        if bad:
            raise NotImplementedError(f"{name}: reshard_after_forward={reshard!r} does not "
                                      f"compose with {what}; keep the default True")
    from shard.core._mesh import Mesh

    mesh = Mesh(comm, {"node": w // size, "local": size})
    return mesh["local"], mesh["node"]
