"""benchmarks/e2e.py runs end to end (a tiny model, one step: a check, not a measurement).
Each of its code paths once: the peers, a ZeRO stage on gloo processes (zero0-zero3 are
one function of the stage), the thread ranks, the profile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_e2e_benchmark_prints_its_table_and_profile():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/e2e.py"), "--sizes", "tiny", "--modes",
         "ddp,fsdp2,zero3,zero3-threads", "--steps", "1", "--warmup", "1", "--passes", "1",
         "--profile", "--timeout", "240"],
        capture_output=True, text=True, timeout=300, check=True)
    rows = {line.split("|")[1].strip() for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| mode")}
    assert {"ddp", "fsdp2", "zero3", "zero3-threads"} <= rows, out.stdout + out.stderr
    assert "where zero3's step goes" in out.stdout and "| backward |" in out.stdout
