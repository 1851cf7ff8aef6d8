"""The public API: what ``from shard import *`` and friends give, and that every
name they promise exists. A change here is a change to users' code: it must
be made on purpose, here and in the README."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "shard": [
        "Breakdown", "CSVLogger", "CheckpointError", "DeepSpeedConfig", "DonatedStateError",
        "Layered", "Layout", "LossScale", "MicroBatches", "Offload", "Pipeline", "Precision",
        "Replicate", "Shard", "TensorBoardLogger", "TrainState", "ZeroStep", "balance_by_time",
        "estimate_memory", "from_deepspeed_config", "from_partition_spec", "gather",
        "init_from_env", "load", "make_layout", "partition", "pipeline", "profile", "save",
        "spawn", "split_batch", "to_partition_spec", "unpartition", "zero0", "zero1", "zero2",
        "zero3"],
    "shard.checkpoint": ["consolidate", "inspect", "run"],
    "ops": [
        "AdamState", "BF16", "CollectiveError", "CollectiveTimeout", "Communicator", "Device",
        "FusedAdam", "HOST", "KernelBuildError", "PeerFailed", "ThreadCommunicator",
        "ThreadGroup", "Work", "adam", "adamw", "aligned_empty", "all_gather", "all_reduce",
        "broadcast", "cast", "device_of", "fused_adam_multi", "fused_adam_step", "global_norm",
        "init_from_env", "reduce_scatter", "spawn", "sum_of_squares"],
    "ops.testing": ["DEVICE_OPS", "STANDIN", "SYNCS", "StandInArray", "xp"],
    "interop": ["data_ptr", "shares_memory", "to_cupy", "to_jax", "to_numpy", "to_torch"],
    "interop.torch": ["TorchLayered", "TorchLoss", "functional", "layered", "load_state",
                      "state_dict"],
    "interop.jax": ["global_params", "local_params", "mesh", "shardings"],
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
