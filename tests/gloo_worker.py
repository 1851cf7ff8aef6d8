"""A rank of the multi-process gloo tests: run by tests/test_comm_gloo.py.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun sets them),
ZS_SCENARIO (what to run) and ZS_OUT (where to write this rank's JSON report).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import numpy as np

import ops
from ops._arrays import BF16

DTYPES = {"f32": np.float32, "f64": np.float64, "bf16": BF16, "f16": np.float16}
SIZES = [0, 1, 7, 1_000_003]


def inputs(rank: int, n: int, dtype) -> np.ndarray:
    return np.random.default_rng(1000 * n + rank).standard_normal(n).astype(dtype)


def check_all(comm) -> list[str]:
    """Every collective x dtype x size against numpy; returns failures."""
    w, failures = comm.world_size, []
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6}
    for name, dtype in DTYPES.items():
        rt = tol.get(np.dtype(dtype), 2e-2)
        for n in SIZES:
            xs = [inputs(r, n, dtype) for r in range(w)]
            mine = xs[comm.rank]
            total = np.sum([x.astype(np.float64) for x in xs], axis=0)
            got = ops.all_gather(comm, mine)
            if not np.array_equal(got, np.concatenate(xs)):
                failures.append(f"all_gather {name} n={n}")
            m = n - n % w
            for op in ("sum", "mean"):
                got = ops.reduce_scatter(comm, mine[:m], op=op).astype(np.float64)
                want = np.split(total[:m] / (w if op == "mean" else 1), w)[comm.rank]
                if not np.allclose(got, want, rtol=rt, atol=rt * w):
                    failures.append(f"reduce_scatter {op} {name} n={n}")
            got = ops.all_reduce(comm, mine).astype(np.float64)
            if not np.allclose(got, total, rtol=rt, atol=rt * w):
                failures.append(f"all_reduce {name} n={n}")
            if not np.array_equal(ops.broadcast(comm, mine, src=w - 1), xs[-1]):
                failures.append(f"broadcast {name} n={n}")
    out = comm.allocate(4 * w, np.float32)
    work = comm.all_gather_async(out, np.full(4, comm.rank, np.float32))
    if not np.array_equal(work.wait(), np.repeat(np.arange(w, dtype=np.float32), 4)):
        failures.append("all_gather_async")
    return failures


def main() -> None:
    scenario, report = os.environ["ZS_SCENARIO"], {"ok": False}
    timeout = float(os.environ.get("ZS_TIMEOUT", "60"))
    try:
        comm = ops.init_from_env(timeout=timeout)
        report["rank"] = comm.rank
        t0 = time.monotonic()
        if scenario == "collectives":
            report["failures"] = check_all(comm)
        elif scenario == "kill":
            comm.barrier()
            if comm.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            ops.all_gather(comm, np.ones(4_000_000, np.float32))
        elif scenario == "mismatch":
            ops.all_gather(comm, np.ones(100_000 + comm.rank, np.float32))
        report["ok"] = True
        report["seconds"] = time.monotonic() - t0
    except Exception as e:
        report.update(error=type(e).__name__, message=str(e), seconds=time.monotonic() - t0,
                      traceback=traceback.format_exc())
    with open(f"{os.environ['ZS_OUT']}.{report.get('rank', os.environ['RANK'])}", "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown, which waits for dead peers


if __name__ == "__main__":
    main()
