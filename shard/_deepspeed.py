"""DeepSpeed JSON configs as the ZeRO transforms' options: :func:`from_deepspeed_config`.

The keys below map onto ``shard.zero0``-``zero3``'s arguments. Keys that tune
DeepSpeed's own buffers and change no result are accepted and listed once in
an info log. Every other key, and every value this library cannot honour, is
reported by name (an error, or with ``unsupported="warn"`` a warning), never
silently ignored.

- ``zero_optimization.stage``: ``zero0``-``zero3``;
  ``overlap_comm``, ``contiguous_gradients``, ``reduce_scatter``: what every
  stage does (false changes no result: accepted and logged);
  ``cpu_offload`` (DeepSpeed's legacy key) is ``offload_optimizer`` on the
  CPU, ``cpu_offload_param`` its ``offload_param``; ``offload_optimizer``: ``device`` ``cpu`` is
  ``shard.Offload("host")``, ``nvme`` with ``nvme_path`` is
  ``shard.Offload("disk", path=nvme_path)``; ``offload_param`` ``cpu`` at
  stage 3 adds ``params="host"``; ``zero_hpz_partition_size`` (ZeRO++'s hpZ,
  the ranks per node; 1, the default, is off): ``reshard_after_forward``;
  ``zero_quantized_weights`` (ZeRO++'s qwZ, stage 3): ``quantized_weights``;
  ``zero_quantized_gradients`` (ZeRO++'s qgZ, stages 1-3):
  ``quantized_gradients=True``, int8 (DeepSpeed's kernels send int4: pass
  ``quantized_gradients=4`` to ``transform`` for that);
- ``fp16``: ``enabled``, ``initial_scale_power``, ``loss_scale_window``,
  ``min_loss_scale``, ``hysteresis`` (DeepSpeed's default 2) and
  ``consecutive_hysteresis``: ``Precision(float16)`` and a
  ``LossScale(rule="deepspeed")``, whose scale moves as DeepSpeed's
  ``DynamicLossScaler``'s; a static ``loss_scale`` (not 0):
  ``LossScale.static``;
- ``bf16.enabled``: ``Precision(bfloat16)`` (``immediate_grad_update`` changes
  no result); ``communication_data_type`` and
  ``data_types.grad_accum_dtype``: the precision's ``reduce_dtype``, the
  dtype gradients are summed in;
- ``gradient_allreduce_op``: ``"mean"`` (the default) or ``"sum"``
  (``gradient_divide_factor=1``: the update of the ranks' summed gradients;
  not at stage 3, as DeepSpeed); ``prescale_gradients`` and
  ``gradient_predivide_factor`` (where DeepSpeed divides: the mean either
  way);
- ``gradient_clipping``: ``clip_norm``;
- ``gradient_accumulation_steps``: the step takes ``shard.MicroBatches`` of
  that many micro-batches (and refuses others); with
  ``train_micro_batch_size_per_gpu`` and ``train_batch_size``, checked against
  each other and the world size;
- ``optimizer``: none (the caller's ``optimizer=`` to
  :meth:`DeepSpeedConfig.transform`, as DeepSpeed takes the one passed to
  ``initialize``); ``Adam`` (``adam_w_mode``, default true, as DeepSpeed's) and
  ``AdamW``: ``ops.adamw`` or ``ops.adam``; ``Lion`` (``lr``, ``betas``,
  ``weight_decay``): ``ops.lion``; ``Lamb`` (``lr``, ``betas``, ``eps``,
  ``weight_decay``, ``bias_correction``, ``min_coeff``/``max_coeff``, as
  DeepSpeed's FusedLamb with its defaults 0.01 and 10): ``ops.lamb``;
  ``OneBitAdam`` (``lr``, ``betas``, ``eps``, ``weight_decay``,
  ``freeze_step``; ``cuda_aware`` and ``comm_backend_name`` pick DeepSpeed's
  transport, which here is the communicator's): ``ops.onebit_adam``, under
  ``zero1``/``zero2`` (DeepSpeed runs it without ZeRO only, so a config
  without ``zero_optimization`` runs under ``zero1``: the same updates, the
  optimizer's state sharded); ``ZeroOneAdam``
  (those, ``var_freeze_step``, ``var_update_scaler``, ``local_step_scaler``,
  ``local_step_clipper``; ``bias_correction`` and ``eps_inside_sqrt``, which
  it does not read): ``ops.zero_one_adam``, likewise;
- ``scheduler``: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
  ``OneCycle`` (with ``cycle_momentum: false``: Adam's ``b1`` is fixed here)
  and ``LRRangeTest``: the same schedule, as the optimizer's ``count -> lr``
  (``shard.lr_range_test(..., schedule=config.optimizer.learning_rate)`` runs
  the range test on it);
- ``tensorboard`` and ``csv_monitor`` (``enabled``, ``output_path``,
  ``job_name``): ``shard.TensorBoardLogger`` and ``shard.CSVLogger``;
- ``wall_clock_breakdown``: every step's ``metrics["time_ms"]`` holds the split.

``"auto"`` values, as Hugging Face's templates write them, resolve from the
arguments of :func:`from_deepspeed_config` (``lr``, ``betas``, ``eps``,
``weight_decay``, ``warmup_steps``, ``total_steps``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``clip_norm``, ``fp16``, ``bf16``), as the
Trainer fills them; ``warmup_min_lr`` is 0, ``train_batch_size`` follows from
the others and the world size, and tuning keys need no value. Any ``"auto"``
left without an argument is named, all of them in one error.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops import FusedOptimizer
from ops._optim import ZeroOne
from shard._deepspeed_optim import offload_of, optimizer_of
from shard._deepspeed_precision import allreduce_op, precision_of
from shard.core._policy import LossScale, Precision
from shard.monitor._loggers import CSVLogger, TensorBoardLogger
from shard.offload._offload import Offload
from shard.step._config import ZeroOptions
from shard.step._step import ZeroStep

if TYPE_CHECKING:
    from ops import Communicator
    from shard.core._mesh import Mesh

__all__ = ["DeepSpeedConfig", "from_deepspeed_config"]

log = logging.getLogger(__name__)
_ALWAYS = ("overlap_comm", "contiguous_gradients", "reduce_scatter")
# Keys that tune DeepSpeed's buffers, logging or placement and change no result.
_TUNING = {
    "": ("steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
         "dump_state", "memory_breakdown", "flops_profiler", "comms_logger",
         "zero_force_ds_cpu_optimizer", "prescale_gradients", "gradient_predivide_factor"),
    "zero_optimization": (
        "allgather_partitions", "allgather_bucket_size", "reduce_bucket_size",
        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size",
        "round_robin_gradients", "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save", "memory_efficient_linear",
        "ignore_unused_parameters", "cpu_offload_use_pin_memory"),
    "zero_optimization.offload_optimizer": ("pin_memory", "buffer_count", "pipeline_read",
                                            "pipeline_write", "fast_init"),
    "zero_optimization.offload_param": ("pin_memory", "buffer_count", "buffer_size",
                                        "max_in_cpu"),
}
# "auto" values and the argument that resolves each (None: needs none)
_AUTO = {
    "optimizer.params.lr": "lr", "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps", "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "lr", "scheduler.params.warmup_num_steps": "warmup_steps",
    "scheduler.params.total_num_steps": "total_steps",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "clip_norm", "fp16.enabled": "fp16", "bf16.enabled": "bf16",
}
_AUTO_FIXED = {"scheduler.params.warmup_min_lr": 0.0}


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed config's meaning here; ``transform`` builds the ZeRO step."""

    stage: int
    optimizer: FusedOptimizer | None  # None: the config has no "optimizer" block
    precision: Precision | None
    loss_scale: LossScale | None
    clip_norm: float | None
    gradient_accumulation_steps: int
    micro_batch_size: int | None
    train_batch_size: int | None
    offload: Offload | None = None
    loggers: tuple = field(default=())
    reshard_after_forward: bool | int = True
    gradient_divide_factor: float | None = None
    quantized_weights: bool = False
    quantized_gradients: bool = False

    # overrides: Any, each of its own ZeroOptions field's type
    def transform(self, loss_fn: object, *, comm: Communicator | None = None,
                  mesh: Mesh | None = None, **overrides: Any) -> ZeroStep:
        """``shard.zero{stage}(loss_fn, ...)`` with this config's options on
        ``comm`` (one data axis) or ``mesh``; ``overrides`` (``optimizer=`` or
        any :class:`shard.ZeroOptions` field) replace them. The step takes
        ``shard.MicroBatches`` of ``gradient_accumulation_steps`` micro-batches
        (a plain batch where it is 1)."""
        from shard._stages import zero0, zero1, zero2, zero3

        if mesh is not None:  # the data ranks: HSDP's replicas x shards, or 'data'
            ranks = mesh.data_ranks()[1]
        else:
            ranks = comm.world_size if comm is not None else 1
        if self.train_batch_size is not None and self.micro_batch_size is not None:
            want = self.micro_batch_size * self.gradient_accumulation_steps * ranks
            if want != self.train_batch_size:
                raise ValueError(f"from_deepspeed_config: train_batch_size {self.train_batch_size}"
                                 f" != train_micro_batch_size_per_gpu {self.micro_batch_size} x "
                                 f"gradient_accumulation_steps {self.gradient_accumulation_steps}"
                                 f" x data ranks {ranks}")
        zero = (zero0, zero1, zero2, zero3)[self.stage]
        optimizer = overrides.pop("optimizer", None) or self.optimizer
        if optimizer is None:
            raise ValueError("from_deepspeed_config: the config has no \"optimizer\" block; "
                             "pass the optimizer as DeepSpeed's initialize takes it: "
                             "config.transform(loss, comm=comm, optimizer=ops.adamw(...))")
        known = {f.name for f in dataclasses.fields(ZeroOptions)}
        odd = sorted(set(overrides) - known)
        if odd:
            raise TypeError(f"DeepSpeedConfig.transform: {odd[0]!r} is not an option of a ZeRO "
                            f"step; the options are {sorted(known)}")
        options = ZeroOptions(
            precision=self.precision, clip_norm=self.clip_norm, loss_scale=self.loss_scale,
            loggers=self.loggers, gradient_accumulation_steps=self.gradient_accumulation_steps,
            offload=self.offload or None, reshard_after_forward=self.reshard_after_forward,
            gradient_divide_factor=self.gradient_divide_factor,
            quantized_weights=self.quantized_weights,
            quantized_gradients=self.quantized_gradients)
        return zero(loss_fn, optimizer=optimizer, mesh=mesh, comm=comm,
                    options=dataclasses.replace(options, **overrides))


def from_deepspeed_config(config: dict | str | os.PathLike, *, unsupported: str = "error",
                          lr: float | None = None, betas: tuple[float, float] | None = None,
                          eps: float | None = None,
                          weight_decay: float | None = None, warmup_steps: int | None = None,
                          total_steps: int | None = None, micro_batch_size: int | None = None,
                          gradient_accumulation_steps: int | None = None,
                          clip_norm: float | None = None, fp16: bool | None = None,
                          bf16: bool | None = None) -> DeepSpeedConfig:
    """Read a DeepSpeed config (a dict, or a JSON file's path).

    Args:
      config: the config.
      unsupported: "error" (default): a ValueError naming every key or value
        that has no meaning here; "warn": log them and go on.
      lr: the value of the config's ``"auto"`` learning rates (see above);
        unused where the config gives a value. Each argument below is the
        value of its own ``"auto"`` entries in the same way.
      betas: as lr.
      eps: as lr.
      weight_decay: as lr.
      warmup_steps: as lr.
      total_steps: as lr.
      micro_batch_size: as lr.
      gradient_accumulation_steps: as lr.
      clip_norm: as lr.
      fp16: as lr.
      bf16: as lr.

    Examples:
      >>> import shard
      >>> cfg = shard.from_deepspeed_config({
      ...     "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
      ...     "bf16": {"enabled": True}, "gradient_clipping": 1.0,
      ...     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}},
      ...     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
      ...                                                  "warmup_max_lr": "auto"}}},
      ...     lr=3e-4)
      >>> cfg.stage, str(cfg.precision.param_dtype), cfg.clip_norm
      (3, 'bfloat16', 1.0)
    """
    if unsupported not in ("error", "warn"):
        raise ValueError(f"from_deepspeed_config: unsupported must be 'error' or 'warn'; got "
                         f"{unsupported!r}")
    given = config if isinstance(config, dict) else json.loads(Path(config).read_text())
    args = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fp16=fp16, bf16=bf16,
                warmup_steps=warmup_steps, total_steps=total_steps, clip_norm=clip_norm,
                micro_batch_size=micro_batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps)
    cfg, tuning = _resolve(copy.deepcopy(given), args)
    bad: list[str] = []

    stage, offload, reshard, qwz, qgz = _zero_section(cfg, bad, tuning)

    precision, loss_scale = precision_of(cfg, bad, tuning)
    divide = allreduce_op(cfg, stage, bad)
    clip = cfg.pop("gradient_clipping", 0.0)
    accumulation = int(cfg.pop("gradient_accumulation_steps", 1))
    micro = cfg.pop("train_micro_batch_size_per_gpu", None)
    total = cfg.pop("train_batch_size", None)
    optimizer = optimizer_of(cfg, bad)
    if optimizer is not None and optimizer.onebit is not None and stage == 0:
        stage = 1  # DeepSpeed runs the 1-bit family without ZeRO only; ZeRO-1: the same updates
        log.info("from_deepspeed_config: %s at zero_optimization.stage 0 runs under zero1 here "
                 "(the same updates, the optimizer's state sharded)",
                 "ZeroOneAdam" if isinstance(optimizer.onebit, ZeroOne) else "OneBitAdam")
    loggers = _loggers(cfg, bad)
    bad += list(cfg)
    if bad:
        text = (f"from_deepspeed_config: not supported here: {', '.join(bad)}; remove them "
                "(or pass unsupported='warn' to go on without them)")
        if unsupported == "error":
            raise ValueError(text)
        log.warning(text)
    if tuning:
        log.info("from_deepspeed_config: accepted with no effect here (they tune DeepSpeed's "
                 "own buffers and change no result): %s", ", ".join(tuning))
    return DeepSpeedConfig(stage=stage, optimizer=optimizer, precision=precision,
                           loss_scale=loss_scale, clip_norm=float(clip) if clip else None,
                           gradient_accumulation_steps=accumulation, micro_batch_size=micro,
                           train_batch_size=total, offload=offload, loggers=loggers,
                           reshard_after_forward=reshard, gradient_divide_factor=divide,
                           quantized_weights=qwz is True and stage == 3,
                           quantized_gradients=qgz is True and stage > 0)


def _zero_section(cfg: dict, bad: list[str], tuning: list[str]) -> tuple[
        int, Offload | None, bool | int, object, object]:
    """The ``zero_optimization`` section, taken out of ``cfg``: the stage, the
    offload, ``reshard_after_forward`` (hpZ's partition size) and ZeRO++'s
    quantized weights and gradients as given (checked: what is wrong goes to
    ``bad``, what only tunes DeepSpeed to ``tuning``)."""
    zero = dict(cfg.pop("zero_optimization", {}) or {})
    stage = zero.pop("stage", 0)
    if stage not in (0, 1, 2, 3):
        bad.append(f"zero_optimization.stage={stage!r}")
        stage = 0
    for key in _ALWAYS:
        if zero.pop(key, True) is not True:
            tuning.append(f"zero_optimization.{key}=false")
    legacy = {"offload_optimizer": zero.pop("cpu_offload", False),
              "offload_param": zero.pop("cpu_offload_param", False)}
    sections = {}
    for key, on in legacy.items():
        section = dict(zero.pop(key, {}) or {})
        if on and section:
            bad.append(f"zero_optimization.{key} with its legacy cpu_offload key")
        sections[key] = section or ({"device": "cpu"} if on else {})
    offload = offload_of(sections["offload_optimizer"], sections["offload_param"], stage, bad)
    if zero.pop("load_from_fp32_weights", True) is not True:
        bad.append("zero_optimization.load_from_fp32_weights=false (checkpoints here restore "
                   "the fp32 masters)")
    reshard: bool | int = True
    hpz = zero.pop("zero_hpz_partition_size", 1)
    if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1:
        bad.append(f"zero_optimization.zero_hpz_partition_size={hpz!r} (an int >= 1)")
    elif hpz > 1 and stage != 3:
        bad.append(f"zero_optimization.zero_hpz_partition_size={hpz} below stage 3")
    elif hpz > 1:
        reshard = hpz
    qwz = zero.pop("zero_quantized_weights", False)
    if not isinstance(qwz, bool):
        bad.append(f"zero_optimization.zero_quantized_weights={qwz!r} (true or false)")
    elif qwz and stage != 3:
        bad.append("zero_optimization.zero_quantized_weights=true below stage 3")
    qgz = zero.pop("zero_quantized_gradients", False)
    if not isinstance(qgz, bool):
        bad.append(f"zero_optimization.zero_quantized_gradients={qgz!r} (true or false)")
    elif qgz and stage == 0:
        bad.append("zero_optimization.zero_quantized_gradients=true at stage 0 (it quantizes "
                   "the reduce-scatter of stages 1-3)")
    bad += [f"zero_optimization.{k}" for k in zero]
    return stage, offload, reshard, qwz, qgz


def _resolve(cfg: dict, args: dict) -> tuple[dict, list[str]]:
    """``cfg`` with its ``"auto"`` values filled from ``args`` and its tuning keys
    taken out (returned by name); every ``"auto"`` left is named in one error."""
    missing, tuning = [], []

    def walk(d: dict, prefix: str) -> None:
        for key in list(d):
            path = f"{prefix}{key}"
            if key in _TUNING.get(prefix.rstrip("."), ()):
                tuning.append(path)
                del d[key]
            elif isinstance(d[key], dict):
                walk(d[key], path + ".")
            elif d[key] == "auto":
                if path in _AUTO_FIXED:
                    d[key] = _AUTO_FIXED[path]
                elif path == "train_batch_size":
                    del d[key]  # follows from the others and the world size
                elif args.get(_AUTO.get(path)) is not None:
                    d[key] = args[_AUTO[path]]
                else:
                    missing.append(f"{path} ({_AUTO[path]}=...)" if path in _AUTO else
                                   f"{path} (no argument resolves it here; give a value)")

    walk(cfg, "")
    if missing:
        raise ValueError("from_deepspeed_config: these \"auto\" values need a value: "
                         + ", ".join(missing))
    return cfg, tuning


def _loggers(cfg: dict, bad: list[str]) -> tuple:
    """``tensorboard`` and ``csv_monitor`` as ``shard.TensorBoardLogger`` and
    ``shard.CSVLogger`` (under ``output_path/job_name``)."""
    out: list[TensorBoardLogger | CSVLogger] = []
    for key, make in (("tensorboard", TensorBoardLogger), ("csv_monitor", CSVLogger)):
        section = dict(cfg.pop(key, {}) or {})
        if not section.pop("enabled", False):
            continue
        where = Path(section.pop("output_path", "") or ".") / section.pop("job_name",
                                                                          "DeepSpeedJobName")
        bad += [f"{key}.{k}" for k in section]
        out.append(make(where if make is TensorBoardLogger else where / "metrics.csv"))
    return tuple(out)
