"""Which submodules of a torch module are its ZeRO-3 units (see [Note: torch
ZeRO-3] in ``_adapter.py``): its children, containers opened, and the model's
repeated blocks wherever they sit."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["default_units", "name_of"]

_CONTAINERS = ("ModuleList", "Sequential", "ModuleDict")


def default_units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The module's units (see [Note: torch ZeRO-3]): its children, with
    containers opened and every module that holds blocks opened down to them."""
    blocks = _block_types(module)
    out = []

    def holds_blocks(m: torch.nn.Module) -> bool:
        return not isinstance(m, blocks) and any(isinstance(d, blocks) for d in m.modules())

    def visit(prefix: str, m: torch.nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if type(child).__name__ in _CONTAINERS or holds_blocks(child):
                visit(path + ".", child)
            else:
                out.append((path, child))

    visit("", module)
    return out


def _block_types(module: torch.nn.Module) -> tuple[type, ...]:
    """The model's repeated blocks: the classes a Hugging Face model names in
    ``_no_split_modules`` (its decoder layers), else the class of every
    ``ModuleList`` or ``Sequential`` whose children, two or more, are all of one
    class (as accelerate's and FSDP's transformer auto-wrap policies find them)."""
    named = set(getattr(module, "_no_split_modules", None) or ())
    found = set()
    for m in module.modules():
        if named:
            if type(m).__name__ in named:
                found.add(type(m))
        elif type(m).__name__ in ("ModuleList", "Sequential"):
            children = list(m.children())
            kinds = {type(c) for c in children}
            # blocks are made of modules: a list of Linear layers is not a stack of blocks
            if (len(children) >= 2 and len(kinds) == 1 and any(True for _ in children[0].children())
                    and children[0].__class__.__name__ not in _CONTAINERS):
                found.add(kinds.pop())
    return tuple(found)


def name_of(root: torch.nn.Module, sub: torch.nn.Module) -> str:
    for name, m in root.named_modules():
        if m is sub:
            return name
    raise ValueError("functional: units must be submodules of the module")
