"""Train a torch ``nn.Module`` with the ZeRO transforms.

``params, loss = interop.torch.functional(model, loss=lambda m, b: ...)`` turns
a module into a params pytree (arrays over the module's own parameter memory:
numpy for a CPU module, CuPy for a CUDA one; named by their state_dict keys) and a loss object whose
``value_and_grad`` runs the module with torch autograd. Hand both to a ZeRO
transform: ``step = shard.zero3(loss, optimizer=..., comm=comm)``,
``state = step.init(params)``. A model too large for one rank is built
under ``torch.device("meta")``: ``init`` then materialises and initialises it
one unit at a time, each rank keeping only its shards. :func:`layered` makes a chain of modules a
pipeline's layers; :func:`load_state` and :func:`state_dict` bring the trained
params back to the module.

The package, a file per concept (it may import :mod:`shard` and :mod:`ops`):

- ``_functional.py``: :func:`functional`, a module as params and a loss object;
- ``_adapter.py``: that :class:`TorchLoss` ([Note: torch ZeRO-3]), which holds
  its module's hooks and buffers;
- ``_units.py``: the unit-by-unit hooks that gather and release each unit, and
  ``_unit_state.py``, what they work out per layout and track per micro-batch;
- ``_blocks.py``: which submodules are the units;
- ``_outputs.py``: what a torch loss may return (a tensor, ``(loss, aux)``, a
  dict or ``ModelOutput`` with a ``loss``);
- ``_layers.py`` and ``_stage.py``: a model as a chain of units, and one
  pipeline stage's run over micro-batches ([Note: torch layers]);
- ``_buffers.py``: the module's buffers and tied names beside its state
  ([Note: torch buffers]);
- ``_state_dict.py``: :func:`load_state` and :func:`state_dict`;
- ``_meta.py``: a module built on the meta device, materialised one unit at a
  time by the step's ``init`` ([Note: meta-device init]);
- ``_parallel.py``: :func:`parallelize`, tensor parallelism by module name
  ([Note: torch tensor parallelism]).
"""

from interop.torch._adapter import TorchLoss
from interop.torch._functional import functional
from interop.torch._layers import TorchLayered, layered
from interop.torch._parallel import parallelize
from interop.torch._state_dict import load_state, state_dict

__all__ = ["TorchLayered", "TorchLoss", "functional", "layered", "load_state", "parallelize",
           "state_dict"]
