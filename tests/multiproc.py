"""Start N real processes with torchrun's environment, for the gloo tests.

[Note: forked launches]
A launched rank spends its first two or so CPU seconds importing torch, JAX and
the library (2.2 s for ``import torch, shard``), and the suite's slow tier started
129 Python processes, most of them ranks. Where
``ZS_FORK_LAUNCH`` is set (``tests/conftest.py`` sets it for the suite),
:func:`launch` starts a script's ranks from a fork server that has imported
:data:`PRELOAD` once (``multiprocessing``'s ``forkserver``, started on first use
by the launching process: a fresh interpreter with no threads and no JAX backend
yet, so forking it is safe). Each rank then runs the script as ``python script
args`` would (``runpy``, its own environment, working directory and ``sys.argv``,
its output to a file read back), from the imports on. The server's environment
is the launching process's when it started: a rank whose variables read at import
(``OMP_*``, ``JAX_*`` and the like) differ from it, or a command that is not
``python script ...``, starts as a fresh process instead. The benchmarks' own
runs (without the variable) start every rank fresh, so that each mode's
memory is its own.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# what every launched rank imports, imported once by the fork server
PRELOAD = ["numpy", "torch", "torch.distributed", "jax", "jax.numpy", "ops", "shard",
           "tests.multiproc"]
# read when the interpreter starts or those modules are imported (their libraries
# loaded): a forked rank cannot change them (PYTHONPATH aside: a rank's path gets the
# repository root, as launch's children have it)
AT_IMPORT = ("OMP_", "MKL_", "OPENBLAS_", "JAX_", "XLA_PYTHON_CLIENT_", "MALLOC_", "GLIBC_",
             "LD_", "PYTHON")
_server: dict[str, Any] = {}


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
    killed when ``timeout`` seconds pass, and ``subprocess.TimeoutExpired`` raised.
    Forked from a server that has done the imports where it can be (see
    [Note: forked launches])."""
    import time

    port = free_port()
    envs = [dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 PYTHONPATH=str(ROOT), **env) for rank in range(world)]
    if _forkable(cmd, envs[0]):
        return _forked(cmd, envs, timeout)
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=e) for e in envs]
    deadline = time.monotonic() + timeout
    try:
        logs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        raise
    return [p.returncode for p in procs], logs


def _at_import(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(AT_IMPORT) and k != "PYTHONPATH"}


def _forkable(cmd: list[str], env: dict[str, str]) -> bool:
    if not os.environ.get("ZS_FORK_LAUNCH") or len(cmd) < 2 or cmd[0] != sys.executable \
            or not cmd[1].endswith(".py"):
        return False
    if not _server:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _server.update(ctx=ctx, env=_at_import(dict(os.environ)))
    return _at_import(env) == _server["env"]


def _forked(cmd: list[str], envs: list[dict[str, str]],
            timeout: float) -> tuple[list[int], list[str]]:
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"{rank}.log") for rank in range(len(envs))]
        procs = [_server["ctx"].Process(target=run_script, args=(cmd, e, log))
                 for e, log in zip(envs, logs, strict=True)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        if any(p.exitcode is None for p in procs):
            for p in procs:
                p.kill()
                p.join()
            raise subprocess.TimeoutExpired(cmd, timeout)
        return [int(p.exitcode or 0) for p in procs], [Path(x).read_text() for x in logs]


def run_script(cmd: list[str], env: dict[str, str], log: str) -> None:
    """In a forked rank: ``cmd`` (``python script args``) as that command would run
    it, with ``env`` as its whole environment and its output to ``log``."""
    import runpy
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    script = str(Path(cmd[1]).resolve())
    sys.argv = [script, *cmd[2:]]
    sys.path[:0] = [os.path.dirname(script), str(ROOT)]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
