"""benchmarks/e2e.py runs end to end (a tiny model, one step: a check, not a measurement).
Each of its code paths once: the peers, a ZeRO stage on gloo processes (zero0-zero3 are
one function of the stage), the thread ranks, the profile."""

from __future__ import annotations

import pytest


@pytest.mark.multiprocess
def test_e2e_benchmark_prints_its_table_and_profile(run_benchmark):
    out = run_benchmark("e2e", "--sizes", "tiny", "--modes", "ddp,fsdp2,zero3,zero3-threads",
                        "--steps", 1, "--warmup", 1, "--passes", 1, "--profile",
                        "--timeout", 240)
    rows = {line.split("|")[1].strip() for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| mode")}
    assert {"ddp", "fsdp2", "zero3", "zero3-threads"} <= rows, out
    assert "where zero3's step goes" in out and "| backward |" in out
