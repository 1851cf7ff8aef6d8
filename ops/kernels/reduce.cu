// Sum of squares of a buffer, in float64, for global-norm clipping and inf/nan
// detection (a non-finite sum is the found-inf flag).
//
// GPU: a grid-stride pass writes one partial per block (warp shuffles, then
// shared memory across warps; no atomics), and a one-block second pass adds
// the partials in a fixed order, so a given launch is deterministic.
// CPU: one call sums any number of tensors: fixed 64 Ki-element chunks summed
// in parallel (16 lanes each), then added in order, so the result does not
// depend on the number of threads.
#include "common.cuh"

#define ZS_REDUCE_BLOCK 256  // launchers must use exactly this block size

// Sum of `acc` over the block; the result is valid in thread 0.
__device__ __forceinline__ double zs_block_sum(double acc) {
  __shared__ double warp_sums[ZS_REDUCE_BLOCK / 32];
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  acc = 0.0;
  if (warp == 0) {
    if (lane < blockDim.x / 32) acc = warp_sums[lane];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  }
  return acc;
}

template <typename T>
__device__ __forceinline__ double zs_sumsq_thread(const T* __restrict__ x, zs_i64 n) {
  double acc = 0.0;
  ZS_GRID_STRIDE(i, n) {
    double v = zs_to_f32(x[i]);
    acc += v * v;
  }
  return acc;
}

// The same over many tensors in one launch: `starts` holds each tensor's first
// index in the concatenated index space (ntensors + 1 entries), `ptrs` each
// tensor's address; a thread steps forward through the tensors as it strides.
template <typename T>
__device__ __forceinline__ double zs_sumsq_table_thread(const zs_i64* __restrict__ ptrs,
                                                        const zs_i64* __restrict__ starts,
                                                        zs_i64 ntensors) {
  double acc = 0.0;
  zs_i64 k = 0, lo = 0, hi = 0;
  const T* x = 0;
  ZS_GRID_STRIDE(i, starts[ntensors]) {
    if (i >= hi) {
      while (i >= starts[k + 1]) ++k;
      lo = starts[k];
      hi = starts[k + 1];
      x = (const T*)ptrs[k];
    }
    double v = zs_to_f32(x[i - lo]);
    acc += v * v;
  }
  return acc;
}

#define ZS_SUMSQ_ENTRY(SUFFIX, T)                                                  \
  extern "C" __global__ void __launch_bounds__(ZS_REDUCE_BLOCK)                   \
      zs_sumsq_partial_##SUFFIX(const T* __restrict__ x, zs_i64 n,                \
                                double* __restrict__ partials) {                   \
    double s = zs_block_sum(zs_sumsq_thread(x, n));                                \
    if (threadIdx.x == 0) partials[blockIdx.x] = s;                                \
  }                                                                                \
  extern "C" __global__ void __launch_bounds__(ZS_REDUCE_BLOCK)                   \
      zs_sumsq_multi_partial_##SUFFIX(const zs_i64* __restrict__ ptrs,            \
                                      const zs_i64* __restrict__ starts,          \
                                      zs_i64 n, double* __restrict__ partials) {  \
    double s = zs_block_sum(zs_sumsq_table_thread<T>(ptrs, starts, n));            \
    if (threadIdx.x == 0) partials[blockIdx.x] = s;                                \
  }                                                                                \
  ZS_HOST(extern "C" void zs_sumsq_##SUFFIX##_host(const zs_i64* __restrict__ ptrs,  \
                                                   const zs_i64* __restrict__ sizes,  \
                                                   zs_i64 n, double* out) {           \
    *out = zs_sumsq_chunked<T>(ptrs, sizes, n);                                        \
  })

#ifdef ZS_CPU
#include <algorithm>
#include <vector>
// 16 running sums per chunk: one float64 accumulator would make the loop wait
// on the adder's latency (about 12 GB/s); four vector accumulators keep up
// with memory. The order of additions is fixed, so results are reproducible.
template <typename T>
static double zs_sumsq_range(const T* __restrict__ x, zs_i64 begin, zs_i64 end) {
  const zs_i64 lanes = 16;
  double acc[lanes] = {0.0};
  zs_i64 i = begin;
  for (; i + lanes <= end; i += lanes) {
#pragma omp simd
    for (zs_i64 j = 0; j < lanes; ++j) {
      double v = zs_to_f32(x[i + j]);
      acc[j] += v * v;
    }
  }
  double tail = 0.0;
  for (; i < end; ++i) {
    double v = zs_to_f32(x[i]);
    tail += v * v;
  }
  for (zs_i64 j = 0; j < lanes; ++j) tail += acc[j];
  return tail;
}

// The sum over several tensors: every tensor's 64 Ki-element chunks go to one
// thread team and the chunks' sums are added in (tensor, chunk) order.
template <typename T>
static double zs_sumsq_chunked(const zs_i64* ptrs, const zs_i64* sizes, zs_i64 ntensors) {
  const zs_i64 chunk = 1 << 16;
  std::vector<zs_i64> first(ntensors + 1, 0);
  for (zs_i64 k = 0; k < ntensors; ++k) first[k + 1] = first[k] + (sizes[k] + chunk - 1) / chunk;
  zs_i64 nchunks = first[ntensors];
  std::vector<double> parts(nchunks);
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (zs_i64 c = 0; c < nchunks; ++c) {
    zs_i64 k = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
    zs_i64 begin = (c - first[k]) * chunk;
    zs_i64 end = begin + chunk < sizes[k] ? begin + chunk : sizes[k];
    parts[c] = zs_sumsq_range((const T*)ptrs[k], begin, end);
  }
  double total = 0.0;
  for (zs_i64 c = 0; c < nchunks; ++c) total += parts[c];
  return total;
}
#endif

ZS_SUMSQ_ENTRY(f32, float)
ZS_SUMSQ_ENTRY(bf16, zs_bf16)
ZS_SUMSQ_ENTRY(f16, zs_f16)

// Second pass: one block adds the partials, each thread a fixed strided subset.
extern "C" __global__ void __launch_bounds__(ZS_REDUCE_BLOCK)
    zs_sumsq_finish(const double* __restrict__ partials, zs_i64 nparts,
                    double* __restrict__ out) {
  double acc = 0.0;
  for (zs_i64 i = threadIdx.x; i < nparts; i += blockDim.x) acc += partials[i];
  double s = zs_block_sum(acc);
  if (threadIdx.x == 0) out[0] = s;
}

// Exact sums of squares (see [Note: exact sums of squares] in ops/_norm.py).
// An element x = M * 2**(e - 150), e its biased float32 exponent (1 for zeros
// and subnormals) and M below 2**24, has x**2 = (H * 2**24 + L) * 2**(2e - 300)
// with H = M*M >> 24 and L = M*M & (2**24 - 1), both below 2**24. The sums of
// H and of L for each e, and the count of non-finite elements, are integers:
// exact in any order, so the result does not depend on the grid, the threads
// or how the data was split. ZS_EXACT_SLOTS int64s: H by e, L by e, the count.
#define ZS_EXACT_SLOTS 513

__device__ __forceinline__ unsigned zs_exact_bucket(float v, unsigned long long* sq) {
  unsigned bits = __float_as_uint(v);
  unsigned e = (bits >> 23) & 0xffu;
  unsigned long long m = (bits & 0x7fffffu) | (e ? 0x800000u : 0u);
  *sq = m * m;
  return e ? e : 1u;  // 255: inf or nan
}

// GPU: each block sums into shared memory (integer atomics) and writes its
// ZS_EXACT_SLOTS sums; zs_exact_sumsq_finish adds the blocks' (integers).
template <typename T>
__device__ __forceinline__ void zs_exact_block(const T* __restrict__ x, zs_i64 n,
                                               zs_i64* __restrict__ partials) {
  __shared__ unsigned long long sums[ZS_EXACT_SLOTS];
  for (unsigned k = threadIdx.x; k < ZS_EXACT_SLOTS; k += blockDim.x) sums[k] = 0;
  __syncthreads();
  ZS_GRID_STRIDE(i, n) {
    unsigned long long sq;
    unsigned e = zs_exact_bucket(zs_to_f32(x[i]), &sq);
    if (e == 255u) {
      atomicAdd(&sums[ZS_EXACT_SLOTS - 1], 1ull);
    } else if (sq) {
      atomicAdd(&sums[e], sq >> 24);
      atomicAdd(&sums[256 + e], sq & 0xffffffull);
    }
  }
  __syncthreads();
  for (unsigned k = threadIdx.x; k < ZS_EXACT_SLOTS; k += blockDim.x)
    partials[(zs_i64)blockIdx.x * ZS_EXACT_SLOTS + k] = (zs_i64)sums[k];
}

#ifdef ZS_CPU
// CPU: each thread sums its contiguous slice into its own slots; the threads'
// slots are added under a lock (integers: any order).
template <typename T>
static void zs_exact_host(const zs_i64* ptrs, const zs_i64* sizes, zs_i64 ntensors,
                          zs_i64* out) {
  for (zs_i64 t = 0; t < ntensors; ++t) {
    const T* x = (const T*)ptrs[t];
    zs_host_for(sizes[t], [x, out](zs_i64 begin, zs_i64 end) {
      unsigned long long local[ZS_EXACT_SLOTS] = {0};
      for (zs_i64 i = begin; i < end; ++i) {
        unsigned long long sq;
        unsigned e = zs_exact_bucket(zs_to_f32(x[i]), &sq);
        if (e == 255u) {
          local[ZS_EXACT_SLOTS - 1] += 1;
        } else {
          local[e] += sq >> 24;
          local[256 + e] += sq & 0xffffffull;
        }
      }
#pragma omp critical(zs_exact)
      for (int k = 0; k < ZS_EXACT_SLOTS; ++k) out[k] += (zs_i64)local[k];
    });
  }
}
#endif

#define ZS_EXACT_ENTRY(SUFFIX, T)                                                    \
  extern "C" __global__ void __launch_bounds__(ZS_REDUCE_BLOCK)                     \
      zs_exact_sumsq_partial_##SUFFIX(const T* __restrict__ x, zs_i64 n,            \
                                      zs_i64* __restrict__ partials) {              \
    zs_exact_block(x, n, partials);                                                  \
  }                                                                                  \
  ZS_HOST(extern "C" void zs_exact_sumsq_##SUFFIX##_host(const zs_i64* __restrict__ ptrs, \
                                                         const zs_i64* __restrict__ sizes, \
                                                         zs_i64 n, zs_i64* out) {         \
    zs_exact_host<T>(ptrs, sizes, n, out);                                                  \
  })

ZS_EXACT_ENTRY(f32, float)
ZS_EXACT_ENTRY(bf16, zs_bf16)
ZS_EXACT_ENTRY(f16, zs_f16)

// Second pass: one block adds the blocks' slots, each thread its own slots.
extern "C" __global__ void __launch_bounds__(ZS_REDUCE_BLOCK)
    zs_exact_sumsq_finish(const zs_i64* __restrict__ partials, zs_i64 nparts,
                          zs_i64* __restrict__ out) {
  for (zs_i64 k = threadIdx.x; k < ZS_EXACT_SLOTS; k += blockDim.x) {
    zs_i64 acc = 0;
    for (zs_i64 b = 0; b < nparts; ++b) acc += partials[b * ZS_EXACT_SLOTS + k];
    out[k] += acc;
  }
}
