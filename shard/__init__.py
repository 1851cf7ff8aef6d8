"""shard: the functional ZeRO core.

Training state as pure pytrees with explicit sharding specs, and ZeRO stages as
function transforms: ``step = shard.zero3(loss_fn, optimizer=..., comm=...)``,
``state = step.init(params)``, ``state, metrics = step(state, batch)``.
"""

from ops import init_from_env, spawn
from shard._checkpoint import CheckpointError, load, save
from shard._deepspeed import DeepSpeedConfig, from_deepspeed_config
from shard._gather import MicroBatches, gather, split_batch
from shard._layout import Layout, make_layout, partition, unpartition
from shard._loss import Layered
from shard._memory import estimate_memory
from shard._monitor import CSVLogger, TensorBoardLogger
from shard._offload import Offload
from shard._pipeline import Pipeline, balance_by_time, pipeline
from shard._policy import LossScale, Precision
from shard._profile import Breakdown, profile
from shard._specs import Replicate, Shard, from_partition_spec, to_partition_spec
from shard._stages import zero0, zero1, zero2, zero3
from shard._state import DonatedStateError, TrainState
from shard._zero import ZeroStep

__all__ = [
    "Breakdown",
    "CSVLogger",
    "CheckpointError",
    "DeepSpeedConfig",
    "DonatedStateError",
    "Layered",
    "Layout",
    "LossScale",
    "MicroBatches",
    "Offload",
    "Pipeline",
    "Precision",
    "Replicate",
    "Shard",
    "TensorBoardLogger",
    "TrainState",
    "ZeroStep",
    "balance_by_time",
    "estimate_memory",
    "from_deepspeed_config",
    "from_partition_spec",
    "gather",
    "init_from_env",
    "load",
    "make_layout",
    "partition",
    "pipeline",
    "profile",
    "save",
    "spawn",
    "split_batch",
    "to_partition_spec",
    "unpartition",
    "zero0",
    "zero1",
    "zero2",
    "zero3",
]
