"""benchmarks/parallel3d.py runs end to end on a small Llama, both frameworks at TP = 2,
and the bytes ours moves between the model ranks equal the analytic count."""

from __future__ import annotations

import pytest


@pytest.mark.multiprocess
def test_parallel3d_benchmark_moves_the_analytic_bytes_and_prints_its_table(run_benchmark):
    out = run_benchmark("parallel3d", "--layouts", "1x2", "--layers", 2, "--hidden", 64,
                        "--ffn", 128, "--heads", 4, "--vocab", 256, "--seq", 16, "--batch", 4,
                        "--steps", 2, "--rounds", 1)
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| 1 x 2")]
    assert len(rows) == 1, out
    row = rows[0]
    assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0
    # (7 L + 2) B S d all-reduced floats, the head's B S V / T gathered, the norm's 8 bytes
    assert row[4] == row[5] == f"{4 * (16 * 4 * 16 * 64 + 4 * 16 * 256 // 2) + 8:,}"
    assert "all_reduce 16" in row[8]  # torch's split issues the same all-reduces
