"""ops.adam / ops.adamw: optax-shaped, checked against optax and torch over pytrees."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import ops


def _tree(rng):
    return {"w": rng.standard_normal((7, 5)).astype(np.float32),
            "blocks": [rng.standard_normal(13).astype(np.float32),
                       np.asarray(rng.standard_normal(), np.float32)]}


def _grads(rng, tree):
    return {"w": rng.standard_normal((7, 5)).astype(np.float32) * 0.1,
            "blocks": [rng.standard_normal(13).astype(np.float32) * 0.1,
                       np.asarray(rng.standard_normal(), np.float32)]}


@pytest.mark.parametrize("schedule", [False, True])
def test_adamw_matches_optax_for_ten_steps(rng, schedule):
    lr = optax.linear_schedule(1e-2, 1e-3, 10) if schedule else 1e-2
    ours, theirs = ops.adamw(lr, weight_decay=0.1), optax.adamw(lr, weight_decay=0.1)
    params = _tree(rng)
    ref = jax.tree_util.tree_map(np.copy, params)
    state, ref_state = ours.init(params), theirs.init(ref)
    for _ in range(10):
        grads = _grads(rng, params)
        params, state = ours.apply(grads, state, params)
        updates, ref_state = theirs.update(grads, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    assert int(state.count) == 10
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref),
                    strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)


def test_update_is_pure_and_composes_like_optax(rng):
    opt = ops.adamw(1e-2)
    params = _tree(rng)
    snapshot = jax.tree_util.tree_map(np.copy, params)
    state = opt.init(params)
    grads = _grads(rng, params)
    updates, new_state = opt.update(grads, state, params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, snapshot)
    assert int(state.count) == 0 and int(new_state.count) == 1
    applied, _ = opt.apply(grads, opt.init(snapshot), snapshot)
    via_updates = optax.apply_updates(params, updates)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7),
                              applied, via_updates)


def test_overflow_skips_without_counting(rng):
    opt = ops.adamw(1e-2)
    params = _tree(rng)
    state = opt.init(params)
    grads = _grads(rng, params)
    grads["w"][0, 0] = np.inf
    before = jax.tree_util.tree_map(np.copy, params)
    sumsq = np.array([sum(float(ops.sum_of_squares(g)[0])
                          for g in jax.tree_util.tree_leaves(grads))])
    params, state = opt.apply(grads, state, params, grad_sumsq=sumsq)
    assert int(state.count) == 0
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, before)


def test_update_needs_params():
    opt = ops.adam(1e-3)
    with pytest.raises(ValueError, match="needs params"):
        opt.update({"w": np.ones(2, np.float32)}, opt.init({"w": np.ones(2, np.float32)}))
