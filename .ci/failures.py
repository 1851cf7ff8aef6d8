"""A pytest plugin for ``.ci/gpu``: each failure is written to ``$FAILURES_LOG`` as it
is reported, so that a run stopped at its time limit still says why tests failed."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("FAILURES_LOG")
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # xdist's controller writes it, once
    if report.failed and path and not worker:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
