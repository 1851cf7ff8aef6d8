"""ops: kernels, communicators and functional collectives for zeroshard.

Arrays and the metal: single-source CUDA/CPU kernels (fused Adam/AdamW, sums of
squares, exact ones too, casts, block-quantised int8 and int4, 1-bit signs with
error feedback, fused Lion and LAMB) and the optimizers built on them (1-bit and 0/1
Adam too); communicators (threads, gloo,
NCCL) and the functional collectives over them. numpy arrays run the CPU
build of each kernel, device arrays (cupy, or the strict stand-in of
:mod:`ops.testing`) its CUDA build: see [Note: devices] in ``ops/device/_device.py``.
"""

from ops._adam import fused_adam_multi, fused_adam_step
from ops._cast import cast
from ops._lamb import fused_lamb
from ops._lion import fused_lion
from ops._norm import exact_square_parts, exact_square_total, global_norm, sum_of_squares
from ops._onebit import onebit_adam
from ops._optim import (
    AdamState,
    FusedAdam,
    FusedOptimizer,
    LionState,
    adam,
    adamw,
    lamb,
    lion,
)
from ops._quant import dequantize_blocks, quantize_blocks
from ops._zeroone import zero_one_adam
from ops.comm._base import (
    CollectiveError,
    CollectiveTimeout,
    Communicator,
    PeerFailed,
    Work,
    aligned_empty,
)
from ops.comm._collectives import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter
from ops.comm._spawn import spawn
from ops.comm._threads import ThreadCommunicator, ThreadGroup
from ops.comm._world import init_from_env
from ops.device._arrays import BF16
from ops.device._device import HOST, Device, device_of
from ops.kernels._build import KernelBuildError

__all__ = [
    "BF16",
    "HOST",
    "AdamState",
    "CollectiveError",
    "CollectiveTimeout",
    "Communicator",
    "Device",
    "FusedAdam",
    "FusedOptimizer",
    "KernelBuildError",
    "LionState",
    "PeerFailed",
    "ThreadCommunicator",
    "ThreadGroup",
    "Work",
    "adam",
    "adamw",
    "aligned_empty",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "cast",
    "dequantize_blocks",
    "device_of",
    "exact_square_parts",
    "exact_square_total",
    "fused_adam_multi",
    "fused_adam_step",
    "fused_lamb",
    "fused_lion",
    "global_norm",
    "init_from_env",
    "lamb",
    "lion",
    "onebit_adam",
    "quantize_blocks",
    "reduce_scatter",
    "spawn",
    "sum_of_squares",
    "zero_one_adam",
]
