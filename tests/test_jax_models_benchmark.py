"""benchmarks/jax_models.py runs and prints its table (a smoke run: one model,
one pass, one step; the numbers are the benchmark's, not a test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_the_jax_models_benchmark_prints_its_table():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "jax_models.py"),
                           "--models", "cnn", "--passes", "1", "--steps", "1"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| cnn |")]
    assert [r.split("|")[2].strip() for r in rows] == ["jax_fsdp", "zero3x2", "pure3x2"], \
        done.stdout
    peak = float(rows[1].split("|")[7])
    assert 0 < peak <= 2.0  # a unit's gather buffer and its copy-out, at most
