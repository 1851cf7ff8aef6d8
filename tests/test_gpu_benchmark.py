"""benchmarks/gpu.py runs end to end on a tiny model on the CPU (its --smoke mode)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_gpu_benchmark_smoke_mode_trains_and_agrees_with_torch(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--steps", "2",
                           "--warmup", "1", "--only", "torch", "zero3x2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows["torch"]["times"]) == len(rows["zero3x2"]["times"]) == 2
    # same init and data; bf16 autocast vs bf16 params: the losses agree to bf16 precision
    assert abs(rows["torch"]["loss"] - rows["zero3x2"]["loss"]) < 0.05
