"""ops: kernels, communicators and functional collectives for zeroshard.

Arrays and the metal: single-source CUDA/CPU kernels (fused Adam/AdamW, sums of
squares, casts), and the optimizers built on them. numpy arrays run the CPU
build of each kernel, cupy arrays its CUDA build.
"""

from ops._adam import fused_adam_step
from ops._arrays import BF16
from ops._build import KernelBuildError
from ops._cast import cast
from ops._norm import global_norm, sum_of_squares
from ops._optim import AdamState, FusedAdam, adam, adamw

__all__ = [
    "BF16",
    "AdamState",
    "FusedAdam",
    "KernelBuildError",
    "adam",
    "adamw",
    "cast",
    "fused_adam_step",
    "global_norm",
    "sum_of_squares",
]
