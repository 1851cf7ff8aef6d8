// Shared device helpers: 16-bit float conversions on raw bits, so that the
// kernels need no CUDA headers (NVRTC from pip ships no cuda_fp16.h) and the
// CPU build uses exactly the same arithmetic. All conversions are select-based
// (no data-dependent branches) so that g++ vectorises the loops that use them.
#pragma once
#ifndef ZS_CPU
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
#endif

// True for finite x; written without library calls so that it means the same
// under nvcc, NVRTC and g++ (none of which may assume finite math here).
__device__ __forceinline__ bool zs_isfinite(double x) { return x - x == 0.0; }

// Storage types: bf16 and fp16 travel as raw 16-bit patterns.
struct zs_bf16 { uint16_t bits; };
struct zs_f16 { uint16_t bits; };
struct zs_none { uint16_t bits; };  // "no output": stores are dropped

// c ? a : b on bit patterns, as arithmetic: g++ if-converts a ternary only
// sometimes, and a loop with a branch in it is not vectorised.
__device__ __forceinline__ uint32_t zs_select(bool c, uint32_t a, uint32_t b) {
  uint32_t mask = 0u - (uint32_t)c;
  return (a & mask) | (b & ~mask);
}

__device__ __forceinline__ float zs_to_f32(float x) { return x; }
__device__ __forceinline__ float zs_to_f32(zs_bf16 x) {
  return __uint_as_float((uint32_t)x.bits << 16);
}
__device__ __forceinline__ float zs_to_f32(zs_f16 x) {
  // fp16 -> fp32, exact. Normal numbers re-bias the exponent; inf/nan get the
  // all-ones exponent; zero/denormals are rebuilt by one exact subtraction.
  uint32_t h = x.bits;
  uint32_t o = (h & 0x7fffu) << 13;
  uint32_t e = o & (0x7c00u << 13);
  uint32_t normal = o + ((127 - 15) << 23);
  uint32_t infnan = normal + ((128 - 16) << 23);
  uint32_t denorm = __float_as_uint(__uint_as_float(normal + (1u << 23)) -
                                    __uint_as_float(113u << 23));
  uint32_t r = zs_select(e == (0x7c00u << 13), infnan, zs_select(e == 0, denorm, normal));
  return __uint_as_float(r | ((h & 0x8000u) << 16));
}

__device__ __forceinline__ uint16_t zs_bf16_bits(float f) {
  // fp32 -> bf16, round to nearest even; NaN stays a quiet NaN.
  uint32_t u = __float_as_uint(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t qnan = (u >> 16) | 0x40u;
  return (uint16_t)zs_select((u & 0x7fffffffu) > 0x7f800000u, qnan, rounded);
}

__device__ __forceinline__ uint16_t zs_f16_bits(float f) {
  // fp32 -> fp16, round to nearest even, overflow to inf, NaN to a quiet NaN.
  uint32_t u = __float_as_uint(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t f32_inf = 255u << 23, f16_max = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t big = zs_select(u > f32_inf, 0x7e00u, 0x7c00u);
  uint32_t tiny = __float_as_uint(__uint_as_float(u) + __uint_as_float(denorm_magic)) -
                  denorm_magic;
  uint32_t mant_odd = (u >> 13) & 1u;
  uint32_t normal = (u + (((uint32_t)(15 - 127)) << 23) + 0xfffu + mant_odd) >> 13;
  uint32_t o = zs_select(u >= f16_max, big, zs_select(u < (113u << 23), tiny, normal));
  return (uint16_t)(o | (sign >> 16));
}

__device__ __forceinline__ void zs_store(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void zs_store(zs_bf16* p, int64_t i, float x) { p[i].bits = zs_bf16_bits(x); }
__device__ __forceinline__ void zs_store(zs_f16* p, int64_t i, float x) { p[i].bits = zs_f16_bits(x); }
__device__ __forceinline__ void zs_store(zs_none*, int64_t, float) {}

// Grid-stride loop bounds for the __global__ drivers.
#define ZS_GRID_STRIDE(i, n)                                               \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)blockDim.x * gridDim.x)

// ZS_HOST(...) keeps its argument only in the CPU build: the fast host drivers.
// zs_host_for(n, body) runs body(begin, end) over contiguous slices of [0, n),
// one per OpenMP thread, with no thread team for small buffers (starting one
// costs more than the work). Each thread works on its own copy of `body`, so
// captured scalars are locals to the vectoriser, not loads through a pointer.
#ifdef ZS_CPU
#define ZS_HOST(...) __VA_ARGS__
template <typename F>
static inline void zs_host_for(int64_t n, const F& body) {
#pragma omp parallel if (n > 65536)
  {
    F local = body;
    int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t per = (n + nt - 1) / nt;
    int64_t begin = t * per < n ? t * per : n;
    int64_t end = begin + per < n ? begin + per : n;
    local(begin, end);
  }
}
#else
#define ZS_HOST(...)
#endif
