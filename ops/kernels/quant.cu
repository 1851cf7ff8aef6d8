// Block-quantised int8 (ZeRO++'s qwZ and qgZ), and int4 below: every group of ZS_QUANT_GROUP elements
// keeps int8 values and one float32 scale, amax / 127 (amax the group's largest
// |x|; 0 for a group of zeros): q = rint(x * (127 / amax)), within [-127, 127],
// and x is read back as q * scale, at most scale / 2 from it (less the float
// rounding of the products). IEEE operations only, so the CPU build and the GPU
// give the same bits.
//
// GPU: one block of ZS_QUANT_GROUP threads per group (grid-stride over groups),
// the group's amax by warp shuffles and shared memory. CPU: groups in parallel.
#include "common.cuh"

#define ZS_QUANT_GROUP 256  // launchers must use exactly this block size

__device__ __forceinline__ signed char zs_quant_one(float x, float inv) {
  float r = rintf(x * inv);
  r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
  return (signed char)r;
}

__device__ __forceinline__ float zs_quant_inv(float amax) {
  return amax > 0.f ? 127.f / amax : 0.f;
}

// The largest of `v` over the block; valid in every thread.
__device__ __forceinline__ float zs_block_max(float v) {
  __shared__ float warp_max[ZS_QUANT_GROUP / 32];
  __shared__ float block_max;
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, off));
  unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? warp_max[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, off));
    if (lane == 0) block_max = v;
  }
  __syncthreads();  // and a thread reads block_max before it reaches the next group's first
  return block_max;
}

template <typename T>
__device__ __forceinline__ void zs_quantize_groups(const T* __restrict__ x,
                                                   signed char* __restrict__ q,
                                                   float* __restrict__ scales, zs_i64 n) {
  zs_i64 groups = (n + ZS_QUANT_GROUP - 1) / ZS_QUANT_GROUP;
  for (zs_i64 g = blockIdx.x; g < groups; g += gridDim.x) {
    zs_i64 i = g * ZS_QUANT_GROUP + threadIdx.x;
    float v = i < n ? zs_to_f32(x[i]) : 0.f;
    float amax = zs_block_max(fabsf(v));
    if (i < n) q[i] = zs_quant_one(v, zs_quant_inv(amax));
    if (threadIdx.x == 0) scales[g] = amax / 127.f;
  }
}

#ifdef ZS_CPU
template <typename T>
static void zs_quantize_host(const T* x, signed char* q, float* scales, zs_i64 n) {
  zs_i64 groups = (n + ZS_QUANT_GROUP - 1) / ZS_QUANT_GROUP;
  zs_host_for(groups, [=](zs_i64 begin, zs_i64 end) {
    for (zs_i64 g = begin; g < end; ++g) {
      zs_i64 lo = g * ZS_QUANT_GROUP, hi = lo + ZS_QUANT_GROUP < n ? lo + ZS_QUANT_GROUP : n;
      float amax = 0.f;
      for (zs_i64 i = lo; i < hi; ++i) amax = fmaxf(amax, fabsf(zs_to_f32(x[i])));
      float inv = zs_quant_inv(amax);
      for (zs_i64 i = lo; i < hi; ++i) q[i] = zs_quant_one(zs_to_f32(x[i]), inv);
      scales[g] = amax / 127.f;
    }
  });
}
#endif

#define ZS_QUANT_ENTRY(SUFFIX, T)                                                        \
  extern "C" __global__ void __launch_bounds__(ZS_QUANT_GROUP)                          \
      zs_quantize_##SUFFIX(const T* __restrict__ x, signed char* __restrict__ q,        \
                           float* __restrict__ scales, zs_i64 n) {                      \
    zs_quantize_groups(x, q, scales, n);                                                 \
  }                                                                                      \
  ZS_HOST(extern "C" void zs_quantize_##SUFFIX##_host(const T* x, signed char* q,      \
                                                      float* scales, zs_i64 n) {       \
    zs_quantize_host(x, q, scales, n);                                                   \
  })                                                                                     \
  extern "C" __global__ void __launch_bounds__(ZS_QUANT_GROUP)                          \
      zs_dequantize_##SUFFIX(const signed char* __restrict__ q,                         \
                             const float* __restrict__ scales, T* __restrict__ y,       \
                             zs_i64 n) {                                                 \
    ZS_GRID_STRIDE(i, n) zs_store(y, i, (float)q[i] * scales[i / ZS_QUANT_GROUP]);      \
  }                                                                                      \
  ZS_HOST(extern "C" void zs_dequantize_##SUFFIX##_host(const signed char* q,          \
                                                        const float* scales, T* y,      \
                                                        zs_i64 n) {                     \
    zs_host_for(n, [=](zs_i64 begin, zs_i64 end) {                                      \
      for (zs_i64 i = begin; i < end; ++i)                                               \
        zs_store(y, i, (float)q[i] * scales[i / ZS_QUANT_GROUP]);                        \
    });                                                                                  \
  })

ZS_QUANT_ENTRY(f32, float)
ZS_QUANT_ENTRY(bf16, zs_bf16)
ZS_QUANT_ENTRY(f16, zs_f16)

// qwZ's copy-out (see [Note: quantized gathers]): the runs of copy.cu (run k
// covers starts[k] <= i < starts[k + 1], read from position runs[2k], written
// to dst + runs[2k + 1]) read the all-gathered int8 sections instead, each
// element dequantized as it is copied: position p is in rank p / section's
// section, whose `blocks` scales start at its start, so the same bits as
// zs_dequantize_* then a copy, in one pass and one launch.
__device__ __forceinline__ float zs_dequant_at(const signed char* __restrict__ q,
                                               const float* __restrict__ scales, zs_i64 p,
                                               zs_i64 section, zs_i64 blocks) {
  return (float)q[p] * scales[(p / section) * blocks + (p % section) / ZS_QUANT_GROUP];
}

#define ZS_DEQUANT_RUNS_PARAMS(D)                                                      \
  const signed char *__restrict__ q, const float *__restrict__ scales,                 \
      D *__restrict__ dst, const zs_i64 *__restrict__ runs,                            \
      const zs_i64 *__restrict__ starts, zs_i64 nruns, zs_i64 section, zs_i64 blocks

template <typename D>
__device__ __forceinline__ void zs_dequantize_runs(ZS_DEQUANT_RUNS_PARAMS(D)) {
  zs_i64 k = 0, lo = 0, hi = 0, from = 0;
  D* to = 0;
  ZS_GRID_STRIDE(i, starts[nruns]) {
    if (i >= hi) {  // a thread walks its indices upwards: the next run is ahead
      while (i >= starts[k + 1]) ++k;
      lo = starts[k];
      hi = starts[k + 1];
      from = runs[2 * k];
      to = dst + runs[2 * k + 1];
    }
    zs_store(to, i - lo, zs_dequant_at(q, scales, from + i - lo, section, blocks));
  }
}

#ifdef ZS_CPU
template <typename D>
static void zs_dequantize_runs_host(ZS_DEQUANT_RUNS_PARAMS(D)) {
  zs_host_for(starts[nruns], [=](zs_i64 begin, zs_i64 end) {
    for (zs_i64 k = 0; k < nruns && starts[k] < end; ++k) {
      zs_i64 lo = begin > starts[k] ? begin : starts[k];
      zs_i64 hi = end < starts[k + 1] ? end : starts[k + 1];
      zs_i64 from = runs[2 * k] - starts[k];
      D* to = dst + runs[2 * k + 1] - starts[k];
      for (zs_i64 i = lo; i < hi; ++i)
        zs_store(to, i, zs_dequant_at(q, scales, from + i, section, blocks));
    }
  });
}
#endif

#define ZS_DEQUANT_RUNS_ENTRY(SUFFIX, D)                                                 \
  extern "C" __global__ void __launch_bounds__(256)                                      \
      zs_dequantize_runs_##SUFFIX(ZS_DEQUANT_RUNS_PARAMS(D)) {                           \
    zs_dequantize_runs<D>(q, scales, dst, runs, starts, nruns, section, blocks);         \
  }                                                                                      \
  ZS_HOST(extern "C" void zs_dequantize_runs_##SUFFIX##_host(ZS_DEQUANT_RUNS_PARAMS(D)) { \
    zs_dequantize_runs_host<D>(q, scales, dst, runs, starts, nruns, section, blocks);    \
  })

ZS_DEQUANT_RUNS_ENTRY(f32, float)
ZS_DEQUANT_RUNS_ENTRY(bf16, zs_bf16)
ZS_DEQUANT_RUNS_ENTRY(f16, zs_f16)

// Block-quantised int4 (ZeRO++'s qgZ at 4 bits): the same groups, scale
// amax / 7, q = rint(x * (7 / amax)) within [-7, 7], stored as q + 8 in a
// nibble: element 2i in the low nibble of byte i, 2i + 1 in the high one (a
// missing last element reads as 0). A group starts at an even index, so a byte
// never holds two groups.
__device__ __forceinline__ float zs_quant4_inv(float amax) {
  return amax > 0.f ? 7.f / amax : 0.f;
}

__device__ __forceinline__ unsigned zs_quant4_one(float x, float inv) {
  float r = rintf(x * inv);
  r = r > 7.f ? 7.f : (r < -7.f ? -7.f : r);
  return (unsigned)((int)r + 8);
}

template <typename T>
__device__ __forceinline__ void zs_quantize4_groups(const T* __restrict__ x,
                                                    unsigned char* __restrict__ q,
                                                    float* __restrict__ scales, zs_i64 n) {
  zs_i64 groups = (n + ZS_QUANT_GROUP - 1) / ZS_QUANT_GROUP;
  for (zs_i64 g = blockIdx.x; g < groups; g += gridDim.x) {
    zs_i64 i = g * ZS_QUANT_GROUP + threadIdx.x;
    float v = i < n ? zs_to_f32(x[i]) : 0.f;
    float amax = zs_block_max(fabsf(v));
    unsigned nib = zs_quant4_one(v, zs_quant4_inv(amax));
    unsigned high = __shfl_down_sync(0xffffffffu, nib, 1);  // the odd neighbour's
    if (threadIdx.x % 2 == 0 && i < n) q[i / 2] = (unsigned char)(nib | (high << 4));
    if (threadIdx.x == 0) scales[g] = amax / 7.f;
  }
}

#ifdef ZS_CPU
template <typename T>
static void zs_quantize4_host(const T* x, unsigned char* q, float* scales, zs_i64 n) {
  zs_i64 groups = (n + ZS_QUANT_GROUP - 1) / ZS_QUANT_GROUP;
  zs_host_for(groups, [=](zs_i64 begin, zs_i64 end) {
    for (zs_i64 g = begin; g < end; ++g) {
      zs_i64 lo = g * ZS_QUANT_GROUP, hi = lo + ZS_QUANT_GROUP < n ? lo + ZS_QUANT_GROUP : n;
      float amax = 0.f;
      for (zs_i64 i = lo; i < hi; ++i) amax = fmaxf(amax, fabsf(zs_to_f32(x[i])));
      float inv = zs_quant4_inv(amax);
      for (zs_i64 i = lo; i < hi; i += 2) {
        unsigned high = i + 1 < hi ? zs_quant4_one(zs_to_f32(x[i + 1]), inv) : 8u;
        q[i / 2] = (unsigned char)(zs_quant4_one(zs_to_f32(x[i]), inv) | (high << 4));
      }
      scales[g] = amax / 7.f;
    }
  });
}
#endif

__device__ __forceinline__ float zs_dequant4_one(const unsigned char* q, const float* scales,
                                                 zs_i64 i) {
  int nib = (q[i / 2] >> ((i % 2) * 4)) & 15;
  return (float)(nib - 8) * scales[i / ZS_QUANT_GROUP];
}

#define ZS_QUANT4_ENTRY(SUFFIX, T)                                                       \
  extern "C" __global__ void __launch_bounds__(ZS_QUANT_GROUP)                          \
      zs_quantize4_##SUFFIX(const T* __restrict__ x, unsigned char* __restrict__ q,     \
                            float* __restrict__ scales, zs_i64 n) {                     \
    zs_quantize4_groups(x, q, scales, n);                                                \
  }                                                                                      \
  ZS_HOST(extern "C" void zs_quantize4_##SUFFIX##_host(const T* x, unsigned char* q,   \
                                                       float* scales, zs_i64 n) {      \
    zs_quantize4_host(x, q, scales, n);                                                  \
  })                                                                                     \
  extern "C" __global__ void __launch_bounds__(ZS_QUANT_GROUP)                          \
      zs_dequantize4_##SUFFIX(const unsigned char* __restrict__ q,                      \
                              const float* __restrict__ scales, T* __restrict__ y,      \
                              zs_i64 n) {                                                \
    ZS_GRID_STRIDE(i, n) zs_store(y, i, zs_dequant4_one(q, scales, i));                 \
  }                                                                                      \
  ZS_HOST(extern "C" void zs_dequantize4_##SUFFIX##_host(const unsigned char* q,       \
                                                         const float* scales, T* y,     \
                                                         zs_i64 n) {                    \
    zs_host_for(n, [=](zs_i64 begin, zs_i64 end) {                                      \
      for (zs_i64 i = begin; i < end; ++i) zs_store(y, i, zs_dequant4_one(q, scales, i)); \
    });                                                                                  \
  })

ZS_QUANT4_ENTRY(f32, float)
ZS_QUANT4_ENTRY(bf16, zs_bf16)
ZS_QUANT4_ENTRY(f16, zs_f16)

// 1-bit compression with error feedback (1-bit Adam's compressed all-reduce):
// over groups of ZS_QUANT_GROUP elements of y = x + e, the scale is the
// group's root mean square, sqrt(sum(y^2) / len), and each element keeps one
// bit, 1 where y >= 0 (or NaN), 0 where y < 0, read back as +scale or -scale;
// e becomes y minus that. Bits are packed eight a byte, element 8i + j at bit j
// of byte i. The group's sum runs in one fixed tree (the warps' shuffles, then
// warp 0's over the warps' sums), which the CPU build repeats, so the scales
// are the same bits on both; every other product is with +-1, exact.
__device__ __forceinline__ float zs_block_sum(float v) {
  __shared__ float warp_sum[ZS_QUANT_GROUP / 32];
  __shared__ float block_sum;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? warp_sum[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) block_sum = v;
  }
  __syncthreads();  // as zs_block_max: read before the next group writes it
  return block_sum;
}

__device__ __forceinline__ float zs_sign_of(unsigned bit) { return bit ? 1.f : -1.f; }

extern "C" __global__ void __launch_bounds__(ZS_QUANT_GROUP)
    zs_sign_compress(const float* __restrict__ x, float* __restrict__ e,
                     unsigned char* __restrict__ bits, float* __restrict__ scales, zs_i64 n) {
  zs_i64 groups = (n + ZS_QUANT_GROUP - 1) / ZS_QUANT_GROUP;
  for (zs_i64 g = blockIdx.x; g < groups; g += gridDim.x) {
    zs_i64 lo = g * ZS_QUANT_GROUP, i = lo + threadIdx.x;
    zs_i64 len = n - lo < ZS_QUANT_GROUP ? n - lo : ZS_QUANT_GROUP;
    float y = i < n ? x[i] + e[i] : 0.f;
    float scale = sqrtf(zs_block_sum(y * y) / (float)len);
    unsigned bit = i < n && !(y < 0.f);
    if (i < n) e[i] = y - scale * zs_sign_of(bit);
    unsigned v = bit << (threadIdx.x % 8);  // the byte's bits, OR-ed to its first lane
    v |= __shfl_down_sync(0xffffffffu, v, 4);
    v |= __shfl_down_sync(0xffffffffu, v, 2);
    v |= __shfl_down_sync(0xffffffffu, v, 1);
    if (threadIdx.x % 8 == 0 && i < n) bits[i / 8] = (unsigned char)v;
    if (threadIdx.x == 0) scales[g] = scale;
  }
}

// y[i] += sign_i * (scale * weight): one rank's part of a sum, or with y zero
// the values themselves.
extern "C" __global__ void __launch_bounds__(256) zs_sign_add(const unsigned char* __restrict__ bits,
                            const float* __restrict__ scales, float* __restrict__ y, zs_i64 n,
                            float weight) {
  ZS_GRID_STRIDE(i, n) {
    unsigned bit = (bits[i / 8] >> (i % 8)) & 1u;
    y[i] += zs_sign_of(bit) * (scales[i / ZS_QUANT_GROUP] * weight);
  }
}

#ifdef ZS_CPU
// zs_block_sum's tree over one group's squares (zero past its end).
static float zs_group_sum_host(const float* sq) {
  float warps[ZS_QUANT_GROUP / 32];
  for (int w = 0; w < ZS_QUANT_GROUP / 32; ++w) {
    float a[32];
    for (int l = 0; l < 32; ++l) a[l] = sq[w * 32 + l];
    for (int off = 16; off > 0; off >>= 1)
      for (int l = 0; l < off; ++l) a[l] += a[l + off];
    warps[w] = a[0];
  }
  float a[32] = {0.f};
  for (int l = 0; l < ZS_QUANT_GROUP / 32; ++l) a[l] = warps[l];
  for (int off = 16; off > 0; off >>= 1)
    for (int l = 0; l < off; ++l) a[l] += a[l + off];
  return a[0];
}

extern "C" void zs_sign_compress_host(const float* x, float* e, unsigned char* bits,
                                      float* scales, zs_i64 n) {
  zs_i64 groups = (n + ZS_QUANT_GROUP - 1) / ZS_QUANT_GROUP;
  zs_host_for(groups, [=](zs_i64 begin, zs_i64 end) {
    for (zs_i64 g = begin; g < end; ++g) {
      zs_i64 lo = g * ZS_QUANT_GROUP, len = n - lo < ZS_QUANT_GROUP ? n - lo : ZS_QUANT_GROUP;
      float y[ZS_QUANT_GROUP], sq[ZS_QUANT_GROUP];
      for (zs_i64 t = 0; t < ZS_QUANT_GROUP; ++t) {
        y[t] = t < len ? x[lo + t] + e[lo + t] : 0.f;
        sq[t] = y[t] * y[t];
      }
      float scale = sqrtf(zs_group_sum_host(sq) / (float)len);
      for (zs_i64 t = 0; t < len; t += 8) {
        unsigned v = 0;
        for (zs_i64 j = 0; j < 8 && t + j < len; ++j) {
          unsigned bit = !(y[t + j] < 0.f);
          e[lo + t + j] = y[t + j] - scale * zs_sign_of(bit);
          v |= bit << j;
        }
        bits[(lo + t) / 8] = (unsigned char)v;
      }
      scales[g] = scale;
    }
  });
}

extern "C" void zs_sign_add_host(const unsigned char* bits, const float* scales, float* y,
                                 zs_i64 n, float weight) {
  zs_host_for(n, [=](zs_i64 begin, zs_i64 end) {
    for (zs_i64 i = begin; i < end; ++i) {
      unsigned bit = (bits[i / 8] >> (i % 8)) & 1u;
      y[i] += zs_sign_of(bit) * (scales[i / ZS_QUANT_GROUP] * weight);
    }
  });
}
#endif
