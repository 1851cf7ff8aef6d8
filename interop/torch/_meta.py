"""Modules larger than one rank: a torch module built on the meta device,
materialised one unit at a time by the step's ``init`` (see [Note: meta-device
init])."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from interop.torch._units import ROOT

if TYPE_CHECKING:
    import torch

__all__ = ["MetaParams"]

# Thread ranks share torch's global RNG: one rank at a time seeds it and draws.
_RNG = threading.Lock()

# [Note: meta-device init]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A module built under ``torch.device("meta")`` has shapes and no memory, as for
# FSDP2's meta-device init or DeepSpeed's ``zero.Init``. ``functional`` swaps
# each meta parameter for an empty one on ``device`` (ties kept: one new
# parameter per old one) and gives buffers their memory at once (they are
# small, and every rank keeps them whole). The params it returns are the meta
# tensors: shapes only. The step's ``init`` then asks for one unit at a time
# (``TorchLoss.materialize``): the unit's parameters get memory, filled with
# NaN, and every module of the unit is initialised in place, children before
# parents as ``Module.apply`` goes, by ``param_init_fn(module)``, else the
# model's own ``_init_weights`` (Hugging Face), else ``reset_parameters()``,
# with torch's RNG seeded from ``seed`` and the unit's name. A parameter still
# NaN afterwards was not initialised by anything and is refused by name. The
# step keeps this rank's rows and drops the rest, so a rank's peak is its
# state plus one unit, and the values depend on the seed and the units, never
# on the world size. A unit's modules are those under its submodule; the root
# unit's are those under no unit, and the owners of the parameters shared
# between units. Buffers start as NaN (an integer type's minimum for integer
# buffers) and are checked the same way once their module is initialised; a
# boolean buffer has no such marker, so one built on meta needs param_init_fn.


def _unset(dtype: torch.dtype) -> float | int:
    """The marker a materialised buffer holds until something initialises it:
    NaN, or an integer type's minimum (no index, count or position is that)."""
    import torch

    return float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min


def _is_unset(b: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.isnan(b) if b.is_floating_point() else b == torch.iinfo(b.dtype).min


class MetaParams:
    """The parameters of a module built on the meta device, materialised on
    request, one unit at a time."""

    def __init__(self, module: Any, units: list[tuple[str, torch.nn.Module]],
                 param_init_fn: Callable[[torch.nn.Module], None] | None, seed: int,
                 device: torch.device | str | int | None) -> None:
        import torch

        self.module, self.seed = module, int(seed)
        self.device = torch.device(device if device is not None else "cpu")
        self.param_init_fn = param_init_fn
        # id(new parameter) -> (shape, dtype)
        self.shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        swapped: dict[int, torch.nn.Parameter] = {}
        for m in module.modules():
            for key, p in list(m._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                q = swapped.get(id(p))
                if q is None:
                    q = swapped[id(p)] = torch.nn.Parameter(
                        torch.empty(0, dtype=p.dtype, device=self.device),
                        requires_grad=p.requires_grad)
                    self.shapes[id(q)] = (tuple(p.shape), p.dtype)
                m._parameters[key] = q
        self.meta = {name: torch.empty(self.shapes[id(q)][0], dtype=q.dtype, device="meta")
                     for name, q in module.named_parameters()}
        self._units = units
        self._check_initialisable()
        self._materialise_buffers()

    def _init(self, m: Any) -> None:
        if self.param_init_fn is not None:
            self.param_init_fn(m)
        elif hasattr(self.module, "_init_weights"):
            self.module._init_weights(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()

    def _check_initialisable(self) -> None:
        if self.param_init_fn is not None or hasattr(self.module, "_init_weights"):
            return
        for name, m in self.module.named_modules():
            if any(True for _ in m.parameters(recurse=False)) and not hasattr(
                    m, "reset_parameters"):
                raise TypeError(
                    f"functional: module {name or '<root>'!r} ({type(m).__name__}) was built on "
                    "the meta device and has no reset_parameters() to initialise its "
                    "parameters; pass param_init_fn=fn(module), which initialises a module's "
                    "own parameters in place")

    def _materialise_buffers(self) -> None:
        """Buffers get memory now, initialised by their module's init where they
        have no parameters beside them (a rotary embedding's frequencies);
        the others are initialised with their unit."""
        import torch

        for name, m in self.module.named_modules():
            metas = [k for k, b in m._buffers.items() if b is not None and b.is_meta]
            for k in metas:
                b = m._buffers[k]
                if b.dtype == torch.bool and self.param_init_fn is None:
                    where = (name + "." if name else "") + k
                    raise TypeError(f"functional: boolean buffer {where!r} was built on the meta "
                                    "device, and nothing can tell whether an initialisation set "
                                    "it; build it outside the meta device context, or pass "
                                    "param_init_fn=fn(module) that sets it")
                m._buffers[k] = torch.full(b.shape, _unset(b.dtype), dtype=b.dtype,
                                           device=self.device)
            if metas and not any(True for _ in m.parameters(recurse=False)):
                with _RNG, torch.random.fork_rng(devices=self._rng_devices()), torch.no_grad():
                    torch.manual_seed(self._seed_for(f"buffers:{name}"))
                    self._init(m)
                self._check_buffers(m)

    def _check_buffers(self, m: torch.nn.Module) -> None:
        """None of ``m``'s own buffers still holds the unset marker."""
        import torch

        for k, b in m.named_buffers(recurse=False):
            if b.dtype != torch.bool and bool(_is_unset(b).any()):
                where = next(n for n, x in self.module.named_modules() if x is m)
                raise ValueError(f"functional: buffer {(where + '.' if where else '') + k!r} was "
                                 f"built on the meta device and not initialised by "
                                 f"{self._init_name()}; pass param_init_fn=fn(module) that "
                                 "initialises it")

    def _rng_devices(self) -> list[int]:
        """The CUDA devices whose RNG the initialisation draws from (and whose
        state is restored afterwards)."""
        if self.device.type != "cuda":
            return []
        import torch

        return [self.device.index if self.device.index is not None
                else torch.cuda.current_device()]

    def _seed_for(self, what: str) -> int:
        return (self.seed * 1_000_003 + zlib.crc32(what.encode())) % (1 << 63)

    def _modules_of(self, keys: set[str], names: list[str],
                    named: dict[str, torch.nn.Parameter]) -> list[torch.nn.Module]:
        """The modules to initialise for ``keys``' units, children first."""
        unit_roots = {id(m): key for key, m in self._units}
        wanted: set[int] = set()

        def visit(m: torch.nn.Module, owner: str) -> None:
            owner = unit_roots.get(id(m), owner)
            if owner in keys:
                wanted.add(id(m))
            for child in m.children():
                visit(child, owner)

        visit(self.module, ROOT)
        if ROOT in keys:  # owners of the parameters the units share
            shared = {id(named[n]) for n in names}
            for m in self.module.modules():
                if any(id(p) in shared for p in m.parameters(recurse=False)):
                    wanted.add(id(m))
        out: list[torch.nn.Module] = []

        def post_order(m: torch.nn.Module) -> None:
            for child in m.children():
                post_order(child)
            if id(m) in wanted and all(m is not o for o in out):
                out.append(m)

        post_order(self.module)
        return out

    def materialize(self, names: list[str], keys: set[str],
                    named: dict[str, torch.nn.Parameter]) -> list[torch.Tensor]:
        """The whole values of parameters ``names`` (of units ``keys``), freshly
        initialised; the module's parameters are empty again afterwards."""
        import torch

        modules = self._modules_of(keys, names, named)
        params: dict[int, torch.nn.Parameter] = {}
        for m in modules:
            for p in m.parameters(recurse=False):
                params.setdefault(id(p), p)
        for n in names:
            params.setdefault(id(named[n]), named[n])
        with _RNG, torch.random.fork_rng(devices=self._rng_devices()), torch.no_grad():
            torch.manual_seed(self._seed_for(",".join(sorted(keys))))
            for p in params.values():
                shape, dtype = self.shapes[id(p)]
                p.data = torch.full(shape, float("nan"), dtype=dtype, device=self.device)
            try:
                for m in modules:
                    self._init(m)
                out = [named[n].data for n in names]
            finally:
                for p in params.values():
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        for m in modules:
            self._check_buffers(m)
        for n, x in zip(names, out, strict=True):
            if bool(torch.isnan(x).any()):
                raise ValueError(
                    f"functional: parameter {n!r} was not initialised by "
                    f"{self._init_name()} (it was built on the meta device); pass "
                    "param_init_fn=fn(module) that initialises every module's own parameters")
        return out

    def _init_name(self) -> str:
        if self.param_init_fn is not None:
            return "param_init_fn"
        return ("the model's _init_weights" if hasattr(self.module, "_init_weights")
                else "its module's reset_parameters()")
