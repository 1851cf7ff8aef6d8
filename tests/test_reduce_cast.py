"""ops.sum_of_squares, ops.global_norm and ops.cast against numpy references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ops
from ops.device._arrays import BF16

SIZES = [0, 1, 7, 65_537, 1_000_003]
DTYPES = [np.float32, BF16, np.float16]
IDS = ["f32", "bf16", "f16"]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_sum_of_squares_matches_float64(rng, n, dtype):
    x = rng.standard_normal(n).astype(dtype)
    want = np.sum(x.astype(np.float64) ** 2)
    got = ops.sum_of_squares(x)
    assert got.dtype == np.float64 and got.shape == (1,)
    np.testing.assert_allclose(got[0], want, rtol=1e-12)


def test_sum_of_squares_is_deterministic_and_flags_overflow(rng):
    x = rng.standard_normal(3_000_001).astype(np.float32)
    assert ops.sum_of_squares(x)[0] == ops.sum_of_squares(x)[0]
    for bad in (np.inf, np.nan):
        y = x.copy()
        y[2_999_999] = bad
        assert not np.isfinite(ops.sum_of_squares(y)[0])
    huge = np.full(4, 6e4, np.float16)  # squares overflow fp16 but not the float64 sum
    assert ops.sum_of_squares(huge)[0] == 4 * 6e4**2 or np.isclose(
        ops.sum_of_squares(huge)[0], 4 * float(np.float16(6e4)) ** 2)


def test_global_norm_over_a_pytree(rng):
    tree = {"a": rng.standard_normal((3, 5)).astype(np.float32),
            "b": [rng.standard_normal(7).astype(BF16), np.zeros(0, np.float32)]}
    want = np.sqrt(sum(np.sum(leaf.astype(np.float64) ** 2)
                       for leaf in (tree["a"], tree["b"][0])))
    assert ops.global_norm(tree) == pytest.approx(want, rel=1e-12)


def _specials() -> np.ndarray:
    bits = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 1,
                     0x00800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x477FF000, 0x477FE000,
                     0x33800000, 0x33000000, 0x387FC000], np.uint32)
    return bits.view(np.float32)


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
def test_cast_from_f32_rounds_to_nearest_even(rng, dtype):
    x = np.concatenate([_specials(), rng.standard_normal(100_000).astype(np.float32) * 1e3,
                        rng.standard_normal(100_000).astype(np.float32) * 1e-6,
                        rng.integers(0, 2**32, 100_000, dtype=np.uint32).view(np.float32)])
    got = ops.cast(x, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(dtype)
    assert got.dtype == np.dtype(dtype)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got.view(np.uint16)[finite], want.view(np.uint16)[finite])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
def test_cast_to_f32_is_exact_for_every_16_bit_pattern(dtype):
    x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype)
    got = ops.cast(x, np.float32)
    want = x.astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(got[nan]).all()


def test_cast_over_a_pytree_and_errors():
    tree = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    out = ops.cast(tree, ml_dtypes.bfloat16)
    assert out["w"].dtype == BF16 and out["w"].shape == (2, 3)
    with pytest.raises(NotImplementedError, match="float32 <-> bfloat16/float16"):
        ops.cast(np.ones(3, np.float16), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="x must have dtype"):
        ops.cast(np.ones(3, np.float64), np.float16)


def test_sum_of_squares_of_a_pytree_is_one_sum(rng):
    tree = {"a": rng.standard_normal(70_001).astype(np.float32),
            "b": [rng.standard_normal(5).astype(BF16), rng.standard_normal(130_000).astype(
                np.float16)], "c": np.zeros(0, np.float32)}
    want = sum(np.sum(x.astype(np.float64) ** 2) for x in (tree["a"], *tree["b"]))
    np.testing.assert_allclose(ops.sum_of_squares(tree)[0], want, rtol=1e-12)
    with pytest.raises(ValueError, match="no arrays"):
        ops.sum_of_squares({})
