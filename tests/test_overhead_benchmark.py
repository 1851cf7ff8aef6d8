"""benchmarks/overhead.py runs end to end on a smaller GPT and prints its tables: each of
its code paths once (the JAX rows' zero3 steps are one function of a Layered or plain loss
and of the ranks: layered3x2 and fn3 between them take every branch)."""

from __future__ import annotations

import pytest


@pytest.mark.multiprocess
def test_overhead_benchmark_prints_time_calls_and_device_operations(run_benchmark):
    out = run_benchmark("overhead", "--modes", "torch", "fsdp2", "zero3", "jax", "jax_fsdp",
                        "layered3x2", "fn3", "--passes", 1, "--steps", 2, "--warmup", 1,
                        "--count-steps", 1, "--layers", 2)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["torch"][1] == "1.00" and rows["fsdp2"][2] == "1.00"
    for mode in ("fsdp2", "zero3"):
        calls, ops_ = rows[mode][3], rows[mode][4]
        assert float(calls) > 0 and float(ops_.split()[0]) > 0, rows[mode]
    assert rows["zero3"][4].split("(")[1].split(",")[3].strip() == "0.0"  # no collective
    for mode in ("jax", "jax_fsdp", "layered3x2", "fn3"):
        assert float(rows[mode][0]) > 0, rows[mode]
