"""A ZeRO step's options and configuration: :class:`ZeroOptions`, the options
``shard.zero3(...)`` takes, written once, and :class:`StepConfig`, those options
checked and resolved with the step's ranks (a :class:`~shard.core._mesh.Topology`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ops import Communicator, FusedOptimizer
from shard.core._data_rank import check_key
from shard.core._layout import min_num_params_of
from shard.core._mesh import Mesh, Topology
from shard.core._optim import is_transformation
from shard.core._policy import LossScale, Precision
from shard.core._protocol import LossProvider, Provided
from shard.core.losses._jax import JaxLoss, classify
from shard.offload._offload import Offload
from shard.offload._offloader import check_offload
from shard.step._checks import check_onebit

__all__ = ["StepConfig", "ZeroOptions", "check_invariant", "option_docs", "protocol_of",
           "resolve_topology"]


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """How a ZeRO step trains: every option of ``shard.zero0``-``zero3`` but the
    loss, the optimizer and the ranks. The most used ones are also keyword
    arguments of ``zero3`` itself (``specs``, ``trainable``, ``precision``,
    ``offload``, ``clip_norm``, ``has_aux``); the rest come as
    ``options=shard.ZeroOptions(...)``, as FSDP2's policies and DeepSpeed's
    config sections do.

    Attributes:
      specs: a spec per leaf, a prefix of the params tree, or one spec
        (default ``Shard(0)`` everywhere; scalars are replicated). With a mesh
        whose ``model`` axis splits the params (tensor parallelism), a
        :class:`shard.TensorParallel` on that mesh: each model rank keeps its
        slices of the whole params, sharded over the data axis (see [Note:
        tensor parallelism with ZeRO]); the gradient norm (and clipping) is the
        whole model's.
      trainable: which leaves train, for fine-tuning: a pytree of bools shaped
        like the params (or a prefix of it), or a function of the params
        returning one, as ``optax.masked`` takes. A leaf marked False is sharded
        and gathered like the rest but never updated (no weight decay, moments
        stay zero) and its gradient is left out of the norm. A torch module's
        ``requires_grad=False`` parameters are frozen without it (see [Note:
        frozen leaves]). Default: all.
      precision: a :class:`shard.Precision` (e.g. bf16 params, fp32 reduction).
        Default: the params' own dtype, so bfloat16 or float16 params compute in
        it, with float32 masters and moments (params mixing dtypes must say).
      offload: a :class:`shard.Offload`: the fp32 masters and Adam's moments in
        host memory (``Offload("host")``) or in files (``Offload("disk",
        path=...)``), updated there by the same kernel; stages 1-3.
        ``Offload("host", overlap=True)`` updates each unit during the backward
        (not with ``clip_norm``).
      clip_norm: clip gradients to this global norm (computed across all shards).
      has_aux: the loss returns ``(loss, aux)`` (JAX's ``value_and_grad``
        convention; a JAX function or ``interop.torch.functional``'s loss), and
        ``metrics["aux"]`` holds aux, its numeric leaves averaged over the
        micro-batches and the ranks (a small host collective each step).
      units: how leaves group into units: None (top-level subtrees), a depth, or
        a function from a leaf's key path to its unit key.
      min_num_params: join consecutive units (of one dtype, in the params' leaf
        order: JAX's, a dict's keys sorted) until each holds at least this many
        elements, a short last one joining the one before it
        (FSDP's ``size_based_auto_wrap_policy``; DeepSpeed leaves params under
        ``stage3_param_persistence_threshold``, 100000, ungathered for the same
        reason): a small unit costs a collective round, and with a JAX loss
        function a segment, for little memory. Default 0: units as given.
        A JAX loss function's option (a torch module's units are its modules).
      prefetch: how many units ahead to all-gather at stage 3.
      reshard_after_forward: stage 3 (FSDP2's argument; DeepSpeed's ZeRO++ hpZ,
        ``zero_hpz_partition_size``): True (default) frees each unit's gathered
        params after use; an int ``L`` dividing the data ranks, the ranks per
        node, keeps a secondary shard of each unit inside every group of ``L``
        consecutive ranks: the forward's gather crosses nodes once (each rank's
        counterparts on the other nodes), and the backward's gather stays inside
        the node; it costs ``1/L`` of the compute params per rank for the step
        (see [Note: secondary shards]). ``False`` keeps them whole (``L = 1``).
      loss_scale: a :class:`shard.LossScale` for dynamic float16 loss scaling.
      gradient_accumulation_steps: if given, every step takes
        ``shard.MicroBatches`` of exactly this many micro-batches (DeepSpeed's
        key; a refusal names the count otherwise). Default: any number.
      gradient_divide_factor: what the gradients summed over the data ranks are
        divided by (FSDP2's ``set_gradient_divide_factor``). Default: the number
        of data ranks, a mean; ``1.0`` keeps the sum (DeepSpeed's
        ``"gradient_allreduce_op": "sum"``). Micro-batches are averaged either
        way.
      weight_by_rows: ranks whose batches hold different numbers of rows (the
        leading dimension) weigh by their rows, so the step's update and loss are
        those of the ranks' batches concatenated, as micro-batches of unequal
        rows always are (see [Note: rows across ranks]); costs one pass over the
        gradient shards. Without it each rank's mean weighs the same, and a step
        whose ranks' rows differ says so in a warning.
      key: a JAX PRNG key (``jax.random.key(0)``) for a JAX loss that draws
        random numbers (dropout): the loss is then called with a keyword
        argument ``key``, a different key on every data rank, step and
        micro-batch, derived from this one (``shard.step_key``; see [Note:
        per-rank keys]).
      axis_name: the data ranks' axis name inside a JAX loss, as under
        ``shard_map``: ``jax.lax.pmean(x, axis_name)`` is the mean over the data
        ranks, every replica's included (``psum`` and ``axis_index`` too), so
        flax's ``BatchNorm(axis_name=...)`` normalises with the global batch's
        statistics, as torch's ``SyncBatchNorm`` (see [Note: the data axis in
        the loss]). Each rank then compiles its own loss.
      loggers: callables ``(step, metrics)`` run after every step on the first
        rank of the mesh, such as ``shard.CSVLogger(path)`` or
        ``shard.TensorBoardLogger(log_dir)``.
      count_flops: ``metrics["flops"]`` (this rank's forward and backward over
        the step's micro-batches) and ``metrics["flops_per_s"]``, counted once
        per batch shape: a JAX loss's from its compiled program, a torch
        module's by torch's FLOP counter (see [Note: model FLOPs]).
      peak_flops: this rank's peak FLOP/s (the device's, for the compute
        dtype): counts FLOPs and adds ``metrics["mfu"]``, the model FLOPs
        utilisation.
      invariant_shards: ``V``, a power of two: the same bits at every number
        of data ranks dividing ``V``. Each micro-batch is cut into ``V`` fixed
        virtual shards (``V / W`` on each of ``W`` data ranks, in the data
        loader's order), each shard's gradient is computed on its own, and
        they are summed in one binary tree fixed by the data, inside a rank and
        across ranks; the norm and the loss are exact sums (see [Note: the
        same bits at any world size]). Costs the smaller micro-batches, the
        tree's partial sums and reductions after the backward.
      quantized_weights: stage 3 all-gathers each unit's params as int8 with
        a float32 scale per block of 256 (DeepSpeed's ZeRO++ qwZ,
        ``zero_quantized_weights``) and computes with them dequantized: about
        a quarter of float32's bytes on the wire (half of bfloat16's), each
        value within half its block's scale of the master's. The shards the
        optimizer updates stay exact. With ``reshard_after_forward=L`` the
        gathers across nodes are the quantized ones (as ZeRO++ composes qwZ
        and hpZ).
      quantized_gradients: stages 1-3 reduce-scatter the gradients with each
        rank's sections for the others sent as int8 with a float32 scale per
        block of 256 and summed in float32 on arrival (DeepSpeed's ZeRO++
        qgZ, ``zero_quantized_gradients``; see [Note: quantized gradient
        reduction] in ``ops/_quant.py``): about a quarter of float32's bytes,
        each other rank's section within half its block's scale. ``4``: as
        int4 (two values a byte, a scale of ``amax / 7``), about an eighth;
        ``True`` is ``8``. With ``reshard_after_forward=L`` the sum is exact
        inside each node and quantized across the nodes, ``1 / L`` of the
        flat form's bytes there (ZeRO++'s hierarchical qgZ).

    Examples:
      >>> import shard
      >>> opts = shard.ZeroOptions(prefetch=2, gradient_accumulation_steps=4)
      >>> opts.prefetch, opts.clip_norm
      (2, None)
    """

    specs: Any = None
    trainable: Any = None
    precision: Precision | None = None
    offload: Offload | None = None
    clip_norm: float | None = None
    has_aux: bool = False
    units: Any = None
    min_num_params: int = 0
    prefetch: int = 1
    reshard_after_forward: bool | int = True
    loss_scale: LossScale | None = None
    gradient_accumulation_steps: int | None = None
    gradient_divide_factor: float | None = None
    weight_by_rows: bool = False
    key: Any = None
    axis_name: str | None = None
    loggers: Any = ()
    count_flops: bool = False
    peak_flops: float | None = None
    invariant_shards: int | None = None
    quantized_weights: bool = False
    quantized_gradients: bool | int = False

    def merged(self, where: str, **given: Any) -> ZeroOptions:
        """These options with ``given`` (``zero3``'s own keyword arguments) set;
        a ValueError naming an option set in both ways to different values."""
        defaults = {f.name: f.default for f in dataclasses.fields(ZeroOptions)}
        changes = {}
        for name, value in given.items():
            if value is defaults[name]:
                continue
            mine = getattr(self, name)
            if mine is not defaults[name] and mine is not value:
                raise ValueError(f"{where}: {name} is given as {name}= and in options=; give "
                                 "it once")
            changes[name] = value
        return dataclasses.replace(self, **changes) if changes else self


def option_docs() -> dict[str, str]:
    """Each option's documentation, from :class:`ZeroOptions`'s docstring (the
    one place it is written), by name."""
    doc = ZeroOptions.__doc__ or ""
    section = doc.split("Attributes:\n", 1)[1].split("\n\n", 1)[0]
    out: dict[str, str] = {}
    for m in re.finditer(r"^      (\w+): (.*?)(?=^      \w+: |\Z)", section, re.S | re.M):
        out[m.group(1)] = m.group(2).rstrip()
    return out


def protocol_of(loss_fn: object) -> tuple[str, LossProvider]:
    """The loss's kind (see ``classify``) and what the step reads of it (see
    [Note: the loss protocol]): a loss object's own answers, a JAX function's
    for a function."""
    kind = classify(loss_fn)
    reads = loss_fn if isinstance(loss_fn, LossProvider) else (
        Provided(loss_fn) if kind == "provider" else LossProvider())
    return kind, reads


def resolve_topology(name: str, stage: int, loss_fn: object, *, mesh: Mesh | None,
                     comm: Communicator | None, tensor_parallel: Any,
                     reshard_after_forward: bool | int) -> tuple[Topology, Any]:
    """The step's ranks from ``mesh=`` or ``comm=`` and the loss (a pipeline's
    mesh, a module split by ``interop.torch.parallelize``), and the
    tensor-parallel split the step runs with (see [Note: topology])."""
    _, reads = protocol_of(loss_fn)
    split = reads.tensor_parallel  # interop.torch.parallelize's module
    if split is not None and tensor_parallel is not None and split is not tensor_parallel:
        raise ValueError(f"{name}: the loss's module was split by interop.torch.parallelize: "
                         "its TensorParallel is the step's; drop specs= or pass that one")
    tp = split if split is not None else tensor_parallel
    topology = Topology.resolve(name, mesh=mesh, comm=comm,
                                model=tp.comm if tp is not None else None,
                                whole=reads.norm_comm, data_axis=reads.data_axis)
    return topology.with_secondary(name, stage, reshard_after_forward), tp


def check_invariant(name: str, o: ZeroOptions, topology: Topology, optimizer: object,
                    tensor_parallel: object) -> None:
    """A ValueError (or NotImplementedError) naming what ``invariant_shards=``
    cannot keep invariant (see [Note: the same bits at any world size])."""
    v = o.invariant_shards
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"{name}: invariant_shards must be a power of two (the virtual "
                         f"shards of each micro-batch); got {v!r}")
    if v % topology.ranks:
        raise ValueError(f"{name}: invariant_shards={v} is not a multiple of the "
                         f"{topology.ranks} data ranks; give a power of two they divide")
    refused = (("a 'model' axis (tensor parallelism)", tensor_parallel is not None),
               ("a pipeline", topology.whole is not None),
               ("weight_by_rows=", o.weight_by_rows),
               ("gradient_divide_factor= (a sum over ranks depends on their number)",
                o.gradient_divide_factor is not None),
               ("axis_name= (collectives inside the loss)", o.axis_name is not None),
               ("Offload(overlap=True) (updates before the whole gradient is summed)",
                o.offload is not None and o.offload.overlap),
               ("an optimizer that reduces over whole leaves (LAMB's trust ratio)",
                isinstance(optimizer, FusedOptimizer) and optimizer.per_tensor))
    for what, bad in refused:
        if bad:
            raise NotImplementedError(f"{name}: invariant_shards= does not compose with {what}; "
                                      "drop one of them")


def _check_layouts(name: str, stage: int, o: ZeroOptions, topology: Topology,
                   tensor_parallel: object) -> None:
    """What a 'replicate' axis (HSDP) and a 'model' axis (tensor parallelism)
    compose with."""
    if topology.replicate is not None:  # see [Note: replicas]
        if stage == 0:
            raise ValueError(f"{name}: zero0 keeps everything whole on every rank: give "
                             "it a mesh without a 'replicate' axis")
        if o.offload is not None and o.offload.overlap:
            raise ValueError(f"{name}: Offload(overlap=True) updates each unit during "
                             "the backward, before the replicas' gradients are summed; "
                             "drop one of them")
    for what, bad in (("a 'replicate' axis (HSDP)", topology.replicate is not None),
                      ("offload=", o.offload is not None)):
        if tensor_parallel is not None and bad:
            raise NotImplementedError(f"{name}: a 'model' axis (tensor parallelism) does "
                                      f"not compose with {what}; drop one of them")
    if tensor_parallel is not None and o.specs is not None:
        raise ValueError(f"{name}: specs= is the TensorParallel; ZeRO shards its slices "
                         "with the default specs")


def _check_quantized(name: str, stage: int, o: ZeroOptions, topology: Topology) -> None:
    """ZeRO++'s quantized_weights= (qwZ) and quantized_gradients= (qgZ)."""
    if not isinstance(o.quantized_weights, bool):
        raise TypeError(f"{name}: quantized_weights must be True or False; got "
                        f"{o.quantized_weights!r}")
    if o.quantized_weights:
        if stage != 3:
            raise ValueError(f"{name}: quantized_weights= quantizes stage 3's all-gather "
                             "of the params; stages 0-2 gather none")
        if o.invariant_shards is not None:
            raise NotImplementedError(f"{name}: quantized_weights= does not compose "
                                      "with invariant_shards=; drop one of them")
    qgz = o.quantized_gradients
    if not (isinstance(qgz, bool) or (isinstance(qgz, int) and qgz in (8, 4))):
        raise TypeError(f"{name}: quantized_gradients must be True, False, 8 or 4 (the "
                        f"bits); got {qgz!r}")
    if qgz:
        if stage == 0:
            raise ValueError(f"{name}: quantized_gradients= quantizes the gradients' "
                             "reduce-scatter; zero0 all-reduces them: use zero1-zero3")
        for what, bad in (("invariant_shards=", o.invariant_shards is not None),
                          ("a 'replicate' axis (HSDP: the gradients cross nodes in the "
                           "replicas' all-reduce, which stays exact)",
                           topology.replicate is not None)):
            if bad:
                raise NotImplementedError(f"{name}: quantized_gradients= does not compose "
                                          f"with {what}; drop one of them")


def _check_scaling(name: str, o: ZeroOptions, topology: Topology) -> float | None:
    """How the gradients are divided (gradient_divide_factor=, weight_by_rows=)
    and accumulated; returns the divide factor (a number, or None)."""
    f = o.gradient_divide_factor
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                          or not f > 0 or f != f or f == float("inf")):
        raise ValueError(f"{name}: gradient_divide_factor must be a finite number > 0; "
                         f"got {f!r}")
    if f is not None and o.weight_by_rows:
        raise ValueError(f"{name}: weight_by_rows divides by the rows of every rank; drop "
                         "gradient_divide_factor= or weight_by_rows=")
    n = o.gradient_accumulation_steps
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{name}: gradient_accumulation_steps must be an int >= 1; got {n!r}")
    if not isinstance(o.weight_by_rows, bool):
        raise TypeError(f"{name}: weight_by_rows must be True or False; got "
                        f"{o.weight_by_rows!r}")
    if o.weight_by_rows and topology.whole is not None:
        raise ValueError(f"{name}: weight_by_rows is for data-parallel ranks; a pipeline's "
                         "stages see the same micro-batches (give its data ranks equal "
                         "rows)")
    if o.weight_by_rows and o.offload is not None and o.offload.overlap:
        raise ValueError(f"{name}: weight_by_rows needs every rank's rows before any update, "
                         "and Offload(overlap=True) updates during the backward; drop one "
                         "of them")
    return f


def _check_loss_options(name: str, o: ZeroOptions, kind: str, reads: LossProvider,
                        loss_fn: object) -> None:
    """The options that need a kind of loss: FLOPs counted, aux returned."""
    peak = o.peak_flops
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))
                             or not 0 < peak < float("inf")):
        raise ValueError(f"{name}: peak_flops must be a FLOP/s > 0 (this rank's device's "
                         f"peak); got {peak!r}")
    if (o.count_flops or peak is not None) and kind != "jax" and reads.counts_flops is None:
        raise NotImplementedError(f"{name}: counting FLOPs is built for a JAX loss function "
                                  "and interop.torch.functional's loss; not for this "
                                  f"{type(loss_fn).__name__}")
    if not isinstance(o.has_aux, bool):
        raise TypeError(f"{name}: has_aux must be True or False; got {o.has_aux!r}")
    if o.has_aux and kind != "jax" and not reads.supports_aux:
        raise TypeError(f"{name}: has_aux=True is for a JAX loss function or "
                        "interop.torch.functional's loss; this "
                        f"{type(loss_fn).__name__} returns its loss alone")


@dataclass(frozen=True, eq=False, kw_only=True)
class StepConfig(ZeroOptions):
    """What a :class:`~shard.ZeroStep` is built with: the loss, the optimizer,
    the ranks and the :class:`ZeroOptions`, checked. Nothing a step learns
    later lives here; the layouts, dtypes and device come from the params, in a
    :class:`~shard.step._plan.Plan` that every state carries."""

    name: str
    stage: int
    loss_fn: LossProvider  # JaxLoss for a JAX function, Provided for a bare object
    kind: str  # "jax", "layered" or "provider" (see classify)
    optimizer: Any  # a FusedOptimizer, or an optax GradientTransformation
    topology: Topology
    precision: Precision
    loggers: tuple
    tensor_parallel: Any = None  # a shard.TensorParallel: the model ranks' split
    key: tuple | None = None  # (raw data, impl or None): see [Note: per-rank keys]
    # The topology's, read on the step's path (plain fields, not properties):
    comm: Communicator = field(init=False)  # the data axis: the ranks ZeRO shards over
    replicate: Communicator | None = field(init=False)  # HSDP's replicas, or None
    ranks: int = field(init=False)  # the data ranks in all, the replicas' included

    __eq__ = object.__eq__  # a configuration is itself (its loss, its communicators)
    __hash__ = object.__hash__

    def __post_init__(self) -> None:
        t = self.topology
        object.__setattr__(self, "comm", t.data)
        object.__setattr__(self, "replicate", t.replicate)
        object.__setattr__(self, "ranks", t.ranks)

    @classmethod
    def make(cls, loss_fn: Any, *, stage: int, optimizer: object, topology: Topology,
             options: ZeroOptions | None = None, tensor_parallel: object = None) -> StepConfig:
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
        if options is not None and not isinstance(options, ZeroOptions):
            raise TypeError(f"{name}: options must be a shard.ZeroOptions(...); got "
                            f"{type(options).__name__}")
        o = options or ZeroOptions()
        kind, reads = protocol_of(loss_fn)
        if o.clip_norm is not None and not o.clip_norm > 0:
            raise ValueError(f"{name}: clip_norm must be > 0; got {o.clip_norm!r}")
        if o.prefetch < 0:
            raise ValueError(f"{name}: prefetch must be >= 0; got {o.prefetch}")
        min_num_params = min_num_params_of(name, o.min_num_params)
        if min_num_params and kind != "jax":
            raise NotImplementedError(f"{name}: min_num_params joins the units of a JAX loss "
                                      "function's params; this "
                                      f"{type(loss_fn).__name__} keeps one unit per layer or "
                                      "module (give units= instead)")
        check_offload(name, stage, o.offload, o.clip_norm)
        _check_layouts(name, stage, o, topology, tensor_parallel)
        _check_quantized(name, stage, o, topology)
        f = _check_scaling(name, o, topology)
        loggers = (o.loggers,) if callable(o.loggers) else tuple(o.loggers or ())
        for lg in loggers:
            if not callable(lg):
                raise TypeError(f"{name}: loggers must be callables (step, metrics), such as "
                                f"shard.CSVLogger; got {type(lg).__name__}")
        _check_loss_options(name, o, kind, reads, loss_fn)
        units = o.units
        if units is None:  # a loss object may know its model's units (interop.torch does)
            units = reads.units if kind == "provider" else None
        key = o.key
        if key is not None:  # see [Note: per-rank keys]
            if kind != "jax":
                raise NotImplementedError(f"{name}: key= gives a JAX loss function its "
                                          "random keys; this "
                                          f"{type(loss_fn).__name__} draws its own")
            key = check_key(name, key)
        if o.invariant_shards is not None:
            check_invariant(name, o, topology, optimizer, tensor_parallel)
        check_onebit(name, stage, o, topology, optimizer, tensor_parallel)
        loss = JaxLoss.shared(loss_fn, o.has_aux) if kind == "jax" else reads
        fields = {f.name: getattr(o, f.name) for f in dataclasses.fields(ZeroOptions)}
        fields.update(units=units, min_num_params=min_num_params, key=key, loggers=loggers,
                      precision=o.precision or Precision(),
                      gradient_divide_factor=None if f is None else float(f),
                      count_flops=bool(o.count_flops) or o.peak_flops is not None)
        return cls(name=name, stage=stage, loss_fn=loss, kind=kind, optimizer=optimizer,
                   topology=topology, tensor_parallel=tensor_parallel, **fields)
