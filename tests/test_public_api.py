"""The public API: what ``from shard import *`` and friends give, and that every
name they promise exists. A change here is a change to users' code: it must
be made on purpose, here and in the README."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

PUBLIC = {
    "shard": [
        "AsyncSave", "Autotuned", "Breakdown", "CSVLogger", "CheckpointError", "DataLoader",
        "DeepSpeedConfig", "DonatedStateError", "LRRangeTest", "Layered", "Layout", "LossScale",
        "Mesh", "MicroBatches", "Offload", "Packed", "Pipeline", "Precision", "PureState",
        "PureStep", "Replicate", "Shard", "TensorBoardLogger", "TensorParallel", "TrainState",
        "ZeroOptions", "ZeroStep", "async_save", "autotune", "balance_by_time", "estimate_memory",
        "from_deepspeed_config", "from_partition_spec", "gather", "init_from_env", "load",
        "lr_range_test", "make_layout", "partition", "pipeline", "profile", "pure_zero3", "save",
        "spawn", "split_batch", "step_key", "to_partition_spec", "unpartition", "zero0", "zero1",
        "zero2", "zero3"],
    "shard.checkpoint": ["consolidate", "inspect", "run", "to_orbax"],
    "ops": [
        "AdamState", "BF16", "CollectiveError", "CollectiveTimeout", "Communicator", "Device",
        "FusedAdam", "FusedOptimizer", "HOST", "KernelBuildError", "LionState", "PeerFailed",
        "ThreadCommunicator", "ThreadGroup", "Work", "adam", "adamw", "aligned_empty",
        "all_gather", "all_reduce", "all_to_all", "broadcast", "cast", "dequantize_blocks",
        "device_of",
        "exact_square_parts", "exact_square_total", "fused_adam_multi", "fused_adam_step",
        "fused_lamb", "fused_lion", "global_norm", "init_from_env", "lamb", "lion", "onebit_adam",
        "quantize_blocks", "reduce_scatter", "spawn", "sum_of_squares",
        "zero_one_adam"],
    "ops.testing": ["DEVICE_OPS", "STANDIN", "SYNCS", "StandInArray", "xp"],
    "interop": ["data_ptr", "shares_memory", "to_cupy", "to_jax", "to_numpy", "to_torch"],
    "interop.torch": ["TorchLayered", "TorchLoss", "functional", "layered", "load_state",
                      "parallelize", "state_dict"],
    "interop.jax": ["global_params", "local_params", "mesh", "named_params", "shardings"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_are_the_promised_ones_and_all_exist(module):
    m = importlib.import_module(module)
    assert sorted(m.__all__) == PUBLIC[module]
    missing = [name for name in m.__all__ if not hasattr(m, name)]
    assert missing == []


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_objects_have_docstrings(module):
    m = importlib.import_module(module)
    undocumented = [name for name in m.__all__
                    if callable(getattr(m, name)) and not (getattr(m, name).__doc__ or "").strip()]
    assert undocumented == []


ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent for top in ("ops", "shard", "interop")
                  for p in (ROOT / top).rglob("__init__.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_folder_says_what_it_holds_and_stays_small(package):
    """The folders are the map of the code: each package's docstring names every
    private module in it, and no folder grows past a dozen modules."""
    name = ".".join(package.relative_to(ROOT).parts)
    doc = importlib.import_module(name).__doc__ or ""
    modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 12, modules
    if package.name in ("ops", "shard", "interop"):  # the roots' docs speak of the API
        return
    unnamed = [m for m in modules if m.startswith("_") and m != "__main__.py" and m not in doc]
    assert unnamed == []


@pytest.mark.parametrize("top", ["ops", "shard", "interop"])
def test_a_module_name_says_one_thing_in_its_package(top):
    """No two modules of one package share a file name (two ``_step.py`` read as
    one in a traceback or a search)."""
    names = [p.name for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py"]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_every_subpackage_has_an_import_contract():
    """pyproject.toml's import-linter contracts place every subpackage (`make
    lint` checks them)."""
    tomllib = pytest.importorskip("tomllib")

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    placed = {layer.strip() for c in contracts for group in c.get("layers", ())
              for layer in group.replace(":", "|").split("|")}
    for package in PACKAGES:
        if package.parent != ROOT:
            assert package.name in placed, package
