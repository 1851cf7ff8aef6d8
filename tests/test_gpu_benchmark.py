"""benchmarks/gpu.py runs end to end on a tiny model on the CPU (its --smoke mode)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.multiprocess
def test_gpu_benchmark_smoke_mode_trains_and_agrees_with_torch(tmp_path, run_benchmark):
    out = tmp_path / "bench.json"
    run_benchmark("gpu", "--smoke", "--steps", 2, "--warmup", 1, "--only", "torch", "zero3x2",
                  "--json", out)
    rows = json.loads(out.read_text())
    assert len(rows["torch"]["times"]) == len(rows["zero3x2"]["times"]) == 2
    # same init and data; bf16 autocast vs bf16 params: the losses agree to bf16 precision
    assert abs(rows["torch"]["loss"] - rows["zero3x2"]["loss"]) < 0.05
