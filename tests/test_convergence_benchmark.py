"""benchmarks/convergence.py runs end to end (a tiny GPT, a few steps: a check, not a
measurement)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_convergence_benchmark_prints_its_table_and_draws_the_curves(tmp_path, monkeypatch,
                                                                     capsys):
    png = tmp_path / "curves.png"
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--steps", "12", "--tail", "4",
                                      "--d-model", "32", "--layers", "1", "--batch", "8",
                                      "--freeze-step", "6", "--plot", str(png)])
    runpy.run_path(str(ROOT / "benchmarks" / "convergence.py"), run_name="__main__")
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): (line.split("|")[2], line.split("|")[4])
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| mode")}
    assert set(rows) == {"exact", "qwz", "qgz", "qgz4", "hpz-qwz-qgz", "hpz-qwz-qgz4",
                         "exact-half",
                         "onebit-warm", "onebit", "zeroone"}, out
    assert rows["exact"][1].strip() == "+0.00%", out
    for mode, (final, gap) in rows.items():
        assert float(final) > 0
        if mode not in ("onebit-warm", "onebit", "zeroone"):  # 6 warm-up updates: too few
            assert abs(float(gap.strip().rstrip("%"))) < 5, out  # 12 steps: close
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
