"""Start N real processes with torchrun's environment, for the gloo tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, world: int, tmp: Path, env: dict[str, str], *,
              timeout: float = 240) -> list[dict]:
    """Run ``script`` as ``world`` processes; return each rank's JSON report."""
    port = free_port()
    out = tmp / "report"
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZS_OUT=str(out),
                 OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
        procs.append(subprocess.Popen([sys.executable, str(ROOT / script)], env=e, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    reports = []
    for rank in range(world):
        path = Path(f"{out}.{rank}")
        reports.append(json.loads(path.read_text()) if path.exists() else
                       {"missing": True, "returncode": procs[rank].returncode,
                        "log": logs[rank][-3000:]})
    return reports
