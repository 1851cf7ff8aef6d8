"""What a JAX user gets wrong first, each refused with an error that names the
leaf or the argument and says what to do: a PRNG key among the params,
params that differ across ranks, PartitionSpec trees as specs, a split of a
dimension other than the first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ops
import shard

PARAMS = {"w": np.ones((5, 3), np.float32), "b": np.zeros(3, np.float32)}


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)


def init(params, world=2, **kw):
    return ops.spawn(lambda c: shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=c,
                                           **kw).init(params), world)


def test_a_prng_key_among_the_params_is_named():
    with pytest.raises(TypeError, match=r"params\['rng'\] is a JAX PRNG key .*nnx.split"):
        init({**PARAMS, "rng": jax.random.key(0)})


def test_params_that_differ_across_ranks_get_jax_advice():
    def run(comm):
        params = {"w": np.full((5, 3), comm.rank, np.float32)}
        shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm).init(params)

    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] differ.*same PRNG key"):
        ops.spawn(run, 2)


def test_partition_spec_trees_are_specs():
    states = init(PARAMS, specs={"w": P("data"), "b": P()})
    assert [s.params["w"].shape for s in states] == [(3, 3), (3, 3)]  # 5 rows: 3 a rank
    assert [s.params["b"].shape for s in states] == [(3,), (3,)]  # replicated
    states = init(PARAMS, specs={"w": P("data", None), "b": P(None)})
    assert states[0].params["w"].shape == (3, 3)


@pytest.mark.parametrize("spec, named", [
    (P(None, "data"), r"P\(None, 'data'\) splits dimension\(s\) \[1\]"),
    (shard.Shard(1), r"Shard\(1\) splits dimension 1"),
])
def test_a_split_of_another_dimension_names_the_leaf(spec, named):
    with pytest.raises(NotImplementedError, match=r"zero3.init: params\['w'\]: " + named):
        init(PARAMS, specs={"w": spec, "b": shard.Replicate()})


def test_something_else_as_a_spec_says_what_a_spec_is():
    with pytest.raises(TypeError, match=r"\['w'\] is not a spec: .*PartitionSpec"):
        init(PARAMS, specs={"w": "data", "b": P()})
