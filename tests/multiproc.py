"""Start N real processes with torchrun's environment, for the gloo tests."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port free now, drawn below the kernel's ephemeral range. Ports from that range
    (``bind`` to port 0, every outgoing connection, a notebook kernel's sockets) are handed
    out all the time while the suite runs, and one could go to another process in the
    seconds before the launched rank 0 binds this one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(64 if low > 12000 else 0):
        port = random.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], world: int, env: dict[str, str], *,
           timeout: float) -> tuple[list[int], list[str]]:
    """Run ``cmd`` as ``world`` processes on this host with torchrun's environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the local ones) but without its
    agent process; return their exit codes and outputs (stdout and stderr). All are
    killed when ``timeout`` seconds pass, and ``subprocess.TimeoutExpired`` raised."""
    import time

    port = free_port()
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True,
                              env=dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                                       WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       PYTHONPATH=str(ROOT), **env))
             for rank in range(world)]
    deadline = time.monotonic() + timeout
    try:
        logs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    return [p.returncode for p in procs], logs


def run_ranks(script: str, world: int, tmp: Path, env: dict[str, str], *,
              timeout: float = 240) -> list[dict]:
    """Run ``script`` as ``world`` processes; return each rank's JSON report."""
    out = tmp / "report"
    codes, logs = launch([sys.executable, str(ROOT / script)], world,
                         {"ZS_OUT": str(out), "OMP_NUM_THREADS": "1", **env}, timeout=timeout)
    reports = []
    for rank in range(world):
        path = Path(f"{out}.{rank}")
        report = json.loads(path.read_text()) if path.exists() else {}
        if not report.get("ok") and "error" not in report:  # it ended without a word: killed
            report.update(missing=True, returncode=codes[rank], log=logs[rank][-3000:])
        reports.append(report)
    return reports


# The scenarios of tests/gloo_worker.py run in turn in one launch of each world size
# (many configurations per launched process group): those that end well, then one that
# ends the launch with a failure, on a group whose collectives time out after the
# seconds given (a rank killed, a payload refused, sizes that do not match).
SHARED = {2: ("collectives", "zero", "torch"), 3: ("collectives",),
          4: ("pipeline", "pipeline_routed", "torch_pipeline", "tensor_parallel")}
LAST = {2: ("mismatch", 20), 3: ("kill", 20), 4: ("p2p", 20)}


def shared_run(scenario: str, world: int, base: Path) -> list[dict]:
    """Each rank's report of ``scenario``, run with the other scenarios of
    ``SHARED[world]`` and ``LAST[world]`` in one launch of ``world`` gloo processes,
    once per test session: the first test to ask runs it (under a file lock in
    ``base``, which pytest-xdist's workers share), the others read its reports. A
    scenario that did not finish reports ``ok`` False with its rank's error and the
    scenario that raised it (``running``), or ``missing`` where the rank was killed."""
    from filelock import FileLock

    last, seconds = LAST[world]
    names = (*SHARED[world], last)
    if scenario not in names:
        raise ValueError(f"{scenario!r} is not among the shared scenarios {names}")
    where = base / f"gloo-shared-{world}"
    with FileLock(f"{where}.lock"):
        done = where / "reports.json"
        if not done.exists():
            where.mkdir(parents=True, exist_ok=True)
            specs = "+".join((*SHARED[world], f"{last}@{seconds:g}"))
            reports = run_ranks("tests/gloo_worker.py", world, where,
                                {"ZS_SCENARIO": specs, "ZS_TIMEOUT": "120"}, timeout=600)
            done.write_text(json.dumps(reports))
        reports = json.loads(done.read_text())
    parts = []
    for rep in reports:
        part = dict(rep.get("parts", {}).get(scenario, {}))
        if not part.get("ok"):
            part.update({k: rep[k] for k in ("running", "error", "message", "traceback",
                                             "missing", "log") if k in rep}, ok=False)
        parts.append(part)
    return parts
