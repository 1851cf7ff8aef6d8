"""interop: torch, JAX and DLPack at the edge of zeroshard.

- :mod:`interop` (this module): zero-copy array bridges between numpy, torch,
  jax and cupy.
- :mod:`interop.torch`: an ``nn.Module`` as a params pytree and a loss the
  ZeRO transforms train, with ZeRO-3 gathering unit by unit through hooks.
- :mod:`interop.jax`: states in and out of JAX, specs as ``NamedSharding``.
"""

from interop._dlpack import data_ptr, shares_memory, to_cupy, to_jax, to_numpy, to_torch

__all__ = ["data_ptr", "shares_memory", "to_cupy", "to_jax", "to_numpy", "to_torch"]


def __getattr__(name: str) -> object:
    """``interop.torch`` and ``interop.jax`` after a bare ``import interop``."""
    if name in ("torch", "jax"):
        import importlib

        return importlib.import_module(f"interop.{name}")
    raise AttributeError(f"module 'interop' has no attribute {name!r}")
