"""One rank of the meta-device init memory test: a ZeRO-3 init of 8 units of 16 MiB
each, and this process's peak resident memory during it.

ZS_SCENARIO: ``meta`` (a torch module built on the meta device), ``eager`` (the
same module built whole first) or ``jax`` (``init_from`` a JAX init function).
ZS_OUT: where to write this rank's JSON report.
"""

from __future__ import annotations

import json
import os

WIDTH, UNITS = 2048, 8


def peak_bytes() -> int:
    """This process's resident high-water mark (``VmHWM``: unlike ``ru_maxrss``,
    not inherited from the parent through fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    import numpy as np
    import torch

    import interop.torch as it
    import ops
    import shard

    scenario = os.environ["ZS_SCENARIO"]
    comm = ops.init_from_env()
    unit_bytes = WIDTH * WIDTH * 4
    if scenario == "jax":
        import jax

        def init_fn(key):
            keys = jax.random.split(key, UNITS)
            return [jax.random.normal(k, (WIDTH, WIDTH)) * 0.02 for k in keys]

        def loss(p, x):
            for w in p:
                x = x @ w
            return (x ** 2).mean()

        step = shard.zero3(loss, optimizer=ops.adam(1e-3), comm=comm)
        jax.jit(lambda k: jax.random.normal(k, (4, 4)))(jax.random.key(1))  # runtime up
        before = peak_bytes()
        state = step.init_from(init_fn, jax.random.key(0))
    else:
        def build() -> torch.nn.Module:
            return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                         for _ in range(UNITS)])

        if scenario == "meta":
            with torch.device("meta"):
                model = build()
        else:
            torch.manual_seed(0)
        before = peak_bytes()
        if scenario == "eager":
            model = build()
        params, fn = it.functional(model, loss=lambda m, x: m(x).pow(2).mean())
        step = shard.zero3(fn, optimizer=ops.adam(1e-3), comm=comm)
        state = step.init(params)
    state_bytes = sum(int(b.nbytes) for b in (*state.master, *state.exp_avg,
                                               *state.exp_avg_sq))
    report = {"rank": comm.rank, "grew": peak_bytes() - before, "state_bytes": state_bytes,
              "unit_bytes": unit_bytes, "model_bytes": UNITS * unit_bytes,
              "digest": float(np.sum([float(np.abs(m).sum()) for m in state.master]))}
    with open(f"{os.environ['ZS_OUT']}.{comm.rank}", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
