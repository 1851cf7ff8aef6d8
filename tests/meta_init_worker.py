"""One rank of the meta-device init memory test: a ZeRO-3 init of 8 units of 16 MiB
each, and how far this process's resident memory rose during it.

ZS_SCENARIO: ``meta`` (a torch module built on the meta device), ``eager`` (the
same module built whole first) or ``jax`` (``init_from`` a JAX init function),
or several of them joined by ``+``, run in turn in this process.
ZS_OUT: where to write this rank's JSON report (one per scenario, by name).
"""

from __future__ import annotations

import json
import os

WIDTH, UNITS = 2048, 8


def status_bytes(field: str) -> int:
    """A size from ``/proc/self/status``: ``VmRSS`` (resident now) or ``VmHWM``
    (the resident high-water mark: unlike ``ru_maxrss``, not inherited from the
    parent through fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Lower the high-water mark to the resident size now (Linux's
    ``clear_refs``) and return it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmHWM")


def init(scenario: str, comm, width: int = WIDTH) -> dict:
    """One scenario's init: the memory it took (``grew``) and its state's size."""
    import numpy as np
    import torch

    import interop.torch as it
    import ops
    import shard

    unit_bytes = width * width * 4
    if scenario == "jax":
        import jax

        def init_fn(key):
            keys = jax.random.split(key, UNITS)
            return [jax.random.normal(k, (width, width)) * 0.02 for k in keys]

        def loss(p, x):
            for w in p:
                x = x @ w
            return (x ** 2).mean()

        step = shard.zero3(loss, optimizer=ops.adam(1e-3), comm=comm)
        before = reset_peak()
        state = step.init_from(init_fn, jax.random.key(0))
    else:
        def build() -> torch.nn.Module:
            return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                         for _ in range(UNITS)])

        if scenario == "meta":
            with torch.device("meta"):
                model = build()
        else:
            torch.manual_seed(0)
        before = reset_peak()
        if scenario == "eager":
            model = build()
        params, fn = it.functional(model, loss=lambda m, x: m(x).pow(2).mean())
        step = shard.zero3(fn, optimizer=ops.adam(1e-3), comm=comm)
        state = step.init(params)
    state_bytes = sum(int(b.nbytes) for b in (*state.master, *state.exp_avg,
                                               *state.exp_avg_sq))
    return {"rank": comm.rank, "grew": status_bytes("VmHWM") - before,
            "state_bytes": state_bytes,
            "unit_bytes": unit_bytes, "model_bytes": UNITS * unit_bytes,
            "digest": float(np.sum([float(np.abs(m).sum()) for m in state.master]))}


def main() -> None:
    """The scenarios of ZS_SCENARIO (``+`` between them) in turn. Each one's
    ``grew`` is counted from the resident size it starts at; ``held_before`` is
    what the scenarios before it left resident (under 1 MiB after a meta
    init, 12-15 MiB after a JAX one), which it may have grown into unseen. So
    ``grew`` is at most what the scenario took, and ``grew + held_before`` at
    least (both exact for the first, as in a process of its own). A small init
    of each scenario runs first, so that lazy imports and the first
    collectives' buffers are not counted as the init's (without it, a meta init
    grew 7 MiB beyond its state and one unit here, and 18 MiB in one CI run)."""
    import gc

    import jax

    import ops

    comm = ops.init_from_env()
    jax.jit(lambda k: jax.random.normal(k, (4, 4)))(jax.random.key(1))  # runtime up
    for scenario in os.environ["ZS_SCENARIO"].split("+"):  # lazy imports, first buffers
        init(scenario, comm, width=16)
    reports, base = {}, status_bytes("VmRSS")
    for scenario in os.environ["ZS_SCENARIO"].split("+"):
        gc.collect()
        held = max(status_bytes("VmRSS") - base, 0)
        reports[scenario] = dict(init(scenario, comm), held_before=held)
    with open(f"{os.environ['ZS_OUT']}.{comm.rank}", "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    # freed blocks of 64 KiB and up go back to the system at once, so the resident
    # size falls when a scenario frees (glibc's MALLOC_MMAP_THRESHOLD_, set here so
    # that the ranks can fork from the launcher's server: see tests/multiproc.py)
    import ctypes

    ctypes.CDLL(None).mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    main()
