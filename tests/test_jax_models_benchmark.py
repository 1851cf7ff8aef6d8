"""benchmarks/jax_models.py runs and prints its table (a smoke run: one model,
one pass, one step; the numbers are the benchmark's, not a test's)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

import shard

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_the_jax_models_benchmark_prints_its_table(run_benchmark):
    out = run_benchmark("jax_models", "--models", "cnn", "--passes", 1, "--steps", 1)
    rows = [line for line in out.splitlines() if line.startswith("| cnn |")]
    assert [r.split("|")[2].strip() for r in rows] == ["jax_fsdp", "zero3x2", "pure3x2"], out
    peak = float(rows[1].split("|")[7])
    # a unit's gather buffer (its rows padded to divide the ranks) and its copy-out, at most
    spec = importlib.util.spec_from_file_location("jax_models",
                                                  ROOT / "benchmarks" / "jax_models.py")
    jax_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jax_models)
    params = jax_models.cnn()[0]
    layout = shard.core._layout.make_layout(params, world_size=2,
                                            min_num_params=jax_models.MIN_NUM_PARAMS)
    whole = [sum(math.prod(layout.leaves[i].shape) for i in u.leaves) for u in layout.units]
    bound = max(2 * u.sharded_size + w for u, w in zip(layout.units, whole, strict=True))
    assert 0 < peak <= bound / sum(whole) + 0.005, (peak, bound / sum(whole))  # printed to 0.01
