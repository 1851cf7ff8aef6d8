"""Writes tests/data/checkpoint-2026-11-23: the checkpoint that
tests/test_checkpoint.py's fixture writes (ZeRO-3 on 4 thread ranks, saved at
step 5), and the params and Adam moments after 10 steps without a break
(expected.npz), so later layouts of the code are checked against files an
earlier one wrote. Made once, at the commit the directory's name dates; run
from the repository root: python tests/data/make_checkpoint_fixture.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ops
import shard
from tests import zero_models as M

OUT = Path(__file__).resolve().parent / "checkpoint-2026-11-23"


def main() -> None:
    data = M.batches(10)
    if OUT.exists():
        shutil.rmtree(OUT)

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm)
        state = step.init(M.init_params())
        for k, b in enumerate(data):
            if k == 5:
                shard.save(state, OUT / "step5", comm=comm, extra={"batch": 5, "seed": [1, 2]})
            state, _ = step(state, shard.split_batch(b, rank=comm.rank,
                                                     world_size=comm.world_size))
        return (shard.gather(state, comm), shard.gather(state.replace(master=state.exp_avg), comm),
                shard.gather(state.replace(master=state.exp_avg_sq), comm))

    leaves = jax.tree_util.tree_leaves(ops.spawn(run, 4)[0])
    np.savez(OUT / "expected.npz", *[np.asarray(x) for x in leaves])


if __name__ == "__main__":
    main()
