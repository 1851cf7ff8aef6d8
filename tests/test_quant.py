"""Block-quantised int8 (ops.quantize_blocks / dequantize_blocks, ops/kernels/quant.cu):
the CPU build against the emulated CUDA kernel, and the error bound."""

from __future__ import annotations

import numpy as np
import pytest

import ops
from ops.device._arrays import BF16

SIZES = [1, 255, 256, 257, 70_001]  # a part of a block, one, one and a bit, many


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_the_cpu_build_and_the_emulated_cuda_kernel_give_the_same_bits(dtype, bits, device_xp):
    xp = device_xp
    rng = np.random.default_rng(0)
    for n in SIZES:
        x = (rng.standard_normal(n) * 2.0 ** rng.integers(-8, 8, n)).astype(dtype)
        q, scales = ops.quantize_blocks(x, bits=bits)
        qd, sd = ops.quantize_blocks(xp.asarray(x), bits=bits)
        np.testing.assert_array_equal(qd.get(), q)
        np.testing.assert_array_equal(sd.get(), scales)
        for out in (np.float32, BF16, np.float16):
            np.testing.assert_array_equal(
                ops.dequantize_blocks(qd, sd, out, bits=bits, size=n).get(),
                ops.dequantize_blocks(q, scales, out, bits=bits, size=n))


@pytest.mark.parametrize("n", SIZES)
def test_each_value_comes_back_within_half_its_blocks_scale(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    q, scales = ops.quantize_blocks(x)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and scales.size == -(-n // 256)
    blocks = np.arange(n) // 256
    amax = np.maximum.reduceat(np.abs(x), np.arange(0, n, 256))
    np.testing.assert_array_equal(scales, (amax / np.float32(127)).astype(np.float32))
    assert np.abs(q.astype(np.int32)).max() <= 127
    assert all(np.abs(q[blocks == b]).max() == 127 for b in range(scales.size))  # amax's value
    err = np.abs(ops.dequantize_blocks(q, scales).astype(np.float64) - x)
    assert (err <= scales[blocks].astype(np.float64) / 2 * (1 + 2.0 ** -20)).all()


@pytest.mark.parametrize("n", SIZES)
def test_int4_values_come_back_within_half_their_blocks_scale(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    q, scales = ops.quantize_blocks(x, bits=4)
    assert q.dtype == np.uint8 and q.size == -(-n // 2) and scales.size == -(-n // 256)
    amax = np.maximum.reduceat(np.abs(x), np.arange(0, n, 256))
    np.testing.assert_array_equal(scales, (amax / np.float32(7)).astype(np.float32))
    values = np.stack([(q & 15).astype(np.int32) - 8, (q >> 4).astype(np.int32) - 8], 1)
    values = values.reshape(-1)[:n]
    assert np.abs(values).max() <= 7
    if n % 2:  # the missing last element reads as 0
        assert q[-1] >> 4 == 8
    blocks = np.arange(n) // 256
    assert all(np.abs(values[blocks == b]).max() == 7 for b in range(scales.size))
    back = ops.dequantize_blocks(q, scales, bits=4, size=n)
    np.testing.assert_array_equal(back, values.astype(np.float32) * scales[blocks])
    err = np.abs(back.astype(np.float64) - x)
    assert (err <= scales[blocks].astype(np.float64) / 2 * (1 + 2.0 ** -20)).all()


def test_zeros_empties_and_bad_arguments():
    q, scales = ops.quantize_blocks(np.zeros(300, np.float32))
    assert not q.any() and not scales.any()
    assert not ops.dequantize_blocks(q, scales).any()
    q, scales = ops.quantize_blocks(np.zeros(0, np.float32))
    assert q.size == 0 and scales.size == 0
    with pytest.raises(TypeError, match="x must have dtype"):
        ops.quantize_blocks(np.zeros(3, np.float64))
    q, scales = ops.quantize_blocks(np.ones(300, np.float32))
    with pytest.raises(ValueError, match="300 values need 2 scales"):
        ops.dequantize_blocks(q, scales[:1])
    with pytest.raises(TypeError, match="int8"):
        ops.dequantize_blocks(q.astype(np.int16), scales)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        ops.quantize_blocks(np.ones(3, np.float32), bits=2)
    q4, s4 = ops.quantize_blocks(np.ones(301, np.float32), bits=4)
    with pytest.raises(ValueError, match="hold 302 or 301 values; pass size="):
        ops.dequantize_blocks(q4, s4, bits=4)
    with pytest.raises(TypeError, match="uint8"):
        ops.dequantize_blocks(q, scales, bits=4, size=300)
