"""The parity harness: a ZeRO run on each rank against a single-process reference.

Every transform is checked the same way: the same init and batches, several
steps, and every rank's shard equal to its slice of the reference's params.
The tests' runs go through three calls:

- :func:`local_batch`: this rank's rows of a global batch (micro-batches of
  them where ``micro > 1``), as ``shard.split_batch`` cuts them;
- :func:`run_steps`: ``step.init(params)`` (or a given state) stepped over the
  batches, each rank on its rows; returns the state and each step's metrics;
- :func:`assert_rank_slices`: each leaf of a rank's shards against the rows
  of the reference's leaf that rank holds, cut here with numpy (not by the
  library), the padding rows of a ``Shard(0)`` param checked to hold zeros.
"""

from __future__ import annotations

import jax
import numpy as np

import shard


def local_batch(batch, comm, micro=1):
    """This rank's rows of ``batch`` (a ``shard.MicroBatches`` of ``micro``
    parts where ``micro > 1``)."""
    mine = shard.split_batch(batch, rank=comm.rank, world_size=comm.world_size)
    if micro == 1:
        return mine
    return shard.MicroBatches(shard.split_batch(mine, rank=i, world_size=micro)
                              for i in range(micro))


def run_steps(step, params, batches, comm, *, micro=1, state=None):
    """``step`` over ``batches`` from ``step.init(params)`` (or ``state``), each
    rank on its rows; returns ``(state, [metrics of each step])``."""
    if state is None:
        state = step.init(params)
    metrics = []
    for b in batches:
        state, m = step(state, local_batch(b, comm, micro))
        metrics.append(m)
    return state, metrics


def assert_rank_slices(got, want, rank, world, *, rtol=1e-5, atol=1e-6, what="",
                       zero_padding=True):
    """``got`` (a rank's params: ``state.params``, or any tree of its local
    leaves) equals its slice of ``want`` (the whole params) leaf by leaf: the
    rows ``rank`` holds of a leaf split over ``world`` ranks, or the whole leaf
    where it is replicated or ``world`` is 1. A split leaf's padding rows hold
    zeros (``zero_padding=False`` for an optimizer's state, which may keep its
    epsilon there, as optax's ``adabelief`` does)."""
    tu = jax.tree_util
    got_leaves = tu.tree_leaves_with_path(got)
    want_leaves = tu.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
    for (path, g), w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        where = f"{what} rank {rank} of {world} {tu.keystr(path)}".strip()
        if g.shape != w.shape:  # a Shard(0) leaf: rows_per_rank rows, then padding
            per = -(-w.shape[0] // world)
            assert g.shape == (per, *w.shape[1:]), (where, g.shape, w.shape)
            w = w[rank * per:(rank + 1) * per]
            assert not zero_padding or not g[w.shape[0]:].any(), f"{where}: padding not zero"
            g = g[:w.shape[0]]
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=where)
