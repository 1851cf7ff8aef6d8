"""shard: the functional ZeRO core.

Training state as pure pytrees with explicit sharding specs, and ZeRO stages as
function transforms: ``step = shard.zero3(loss_fn, optimizer=..., comm=...)``,
``state = step.init(params)``, ``state, metrics = step(state, batch)``.
"""

from ops import init_from_env, spawn
from shard._deepspeed import DeepSpeedConfig, from_deepspeed_config
from shard._memory import estimate_memory
from shard._pure import PureState, PureStep, pure_zero3
from shard._stages import zero0, zero1, zero2, zero3
from shard.checkpoint._async import AsyncSave, async_save
from shard.checkpoint._checkpoint import CheckpointError, save
from shard.checkpoint._load import load
from shard.core._data_rank import step_key
from shard.core._gather import MicroBatches, gather, split_batch
from shard.core._layout import Layout, make_layout, partition, unpartition
from shard.core._mesh import Mesh
from shard.core._policy import LossScale, Precision
from shard.core._specs import Replicate, Shard, from_partition_spec, to_partition_spec
from shard.core._state import DonatedStateError, TrainState
from shard.core.losses._layered import Layered
from shard.data._loader import DataLoader
from shard.monitor._loggers import CSVLogger, TensorBoardLogger
from shard.monitor._profile import Breakdown, profile
from shard.offload._offload import Offload
from shard.pipelines._pipeline import Pipeline, balance_by_time, pipeline
from shard.step._config import ZeroOptions
from shard.step._step import ZeroStep
from shard.tensor_parallel._parallel import Packed, TensorParallel
from shard.tuning._autotune import Autotuned, autotune
from shard.tuning._lr_range import LRRangeTest, lr_range_test

__all__ = [
    "AsyncSave",
    "Autotuned",
    "Breakdown",
    "CSVLogger",
    "CheckpointError",
    "DataLoader",
    "DeepSpeedConfig",
    "DonatedStateError",
    "LRRangeTest",
    "Layered",
    "Layout",
    "LossScale",
    "Mesh",
    "MicroBatches",
    "Offload",
    "Packed",
    "Pipeline",
    "Precision",
    "PureState",
    "PureStep",
    "Replicate",
    "Shard",
    "TensorBoardLogger",
    "TensorParallel",
    "TrainState",
    "ZeroOptions",
    "ZeroStep",
    "async_save",
    "autotune",
    "balance_by_time",
    "estimate_memory",
    "from_deepspeed_config",
    "from_partition_spec",
    "gather",
    "init_from_env",
    "load",
    "lr_range_test",
    "make_layout",
    "partition",
    "pipeline",
    "profile",
    "pure_zero3",
    "save",
    "spawn",
    "split_batch",
    "step_key",
    "to_partition_spec",
    "unpartition",
    "zero0",
    "zero1",
    "zero2",
    "zero3",
]
