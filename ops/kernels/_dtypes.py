"""The dtypes the kernels compute in that numpy does not name: bf16 is
``ml_dtypes.bfloat16`` (the dtype JAX uses for numpy arrays)."""

import ml_dtypes
import numpy as np

__all__ = ["BF16"]

BF16 = np.dtype(ml_dtypes.bfloat16)
