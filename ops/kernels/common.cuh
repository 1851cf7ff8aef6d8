// Shared device helpers: 16-bit float conversions on raw bits, so that the
// kernels need no CUDA headers (NVRTC from pip ships no cuda_fp16.h) and the
// CPU build uses exactly the same arithmetic. All conversions are select-based
// (no data-dependent branches) so that g++ vectorises the loops that use them.
#pragma once
// Fixed-width types under names of our own: NVRTC has no <cstdint>, and nvcc
// brings one in through cuda_runtime.h, so neither can declare zs_i64 here.
typedef unsigned short zs_u16;
typedef unsigned int zs_u32;
typedef long long zs_i64;

// True for finite x; written without library calls so that it means the same
// under nvcc, NVRTC and g++ (none of which may assume finite math here).
__device__ __forceinline__ bool zs_isfinite(double x) { return x - x == 0.0; }

// Storage types: bf16 and fp16 travel as raw 16-bit patterns.
struct zs_bf16 { zs_u16 bits; };
struct zs_f16 { zs_u16 bits; };
struct zs_none { zs_u16 bits; };  // "no output": stores are dropped

// c ? a : b on bit patterns, as arithmetic: g++ if-converts a ternary only
// sometimes, and a loop with a branch in it is not vectorised.
__device__ __forceinline__ zs_u32 zs_select(bool c, zs_u32 a, zs_u32 b) {
  zs_u32 mask = 0u - (zs_u32)c;
  return (a & mask) | (b & ~mask);
}

__device__ __forceinline__ float zs_to_f32(float x) { return x; }
__device__ __forceinline__ float zs_to_f32(zs_bf16 x) {
  return __uint_as_float((zs_u32)x.bits << 16);
}
__device__ __forceinline__ float zs_to_f32(zs_f16 x) {
  // fp16 -> fp32, exact. Normal numbers re-bias the exponent; inf/nan get the
  // all-ones exponent; zero/denormals are rebuilt by one exact subtraction.
  zs_u32 h = x.bits;
  zs_u32 o = (h & 0x7fffu) << 13;
  zs_u32 e = o & (0x7c00u << 13);
  zs_u32 normal = o + ((127 - 15) << 23);
  zs_u32 infnan = normal + ((128 - 16) << 23);
  zs_u32 denorm = __float_as_uint(__uint_as_float(normal + (1u << 23)) -
                                    __uint_as_float(113u << 23));
  zs_u32 r = zs_select(e == (0x7c00u << 13), infnan, zs_select(e == 0, denorm, normal));
  return __uint_as_float(r | ((h & 0x8000u) << 16));
}

__device__ __forceinline__ zs_u16 zs_bf16_bits(float f) {
  // fp32 -> bf16, round to nearest even; NaN stays a quiet NaN.
  zs_u32 u = __float_as_uint(f);
  zs_u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  zs_u32 qnan = (u >> 16) | 0x40u;
  return (zs_u16)zs_select((u & 0x7fffffffu) > 0x7f800000u, qnan, rounded);
}

__device__ __forceinline__ zs_u16 zs_f16_bits(float f) {
  // fp32 -> fp16, round to nearest even, overflow to inf, NaN to a quiet NaN.
  zs_u32 u = __float_as_uint(f);
  zs_u32 sign = u & 0x80000000u;
  u ^= sign;
  const zs_u32 f32_inf = 255u << 23, f16_max = (127u + 16u) << 23;
  const zs_u32 denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  zs_u32 big = zs_select(u > f32_inf, 0x7e00u, 0x7c00u);
  zs_u32 tiny = __float_as_uint(__uint_as_float(u) + __uint_as_float(denorm_magic)) -
                  denorm_magic;
  zs_u32 mant_odd = (u >> 13) & 1u;
  zs_u32 normal = (u + (((zs_u32)(15 - 127)) << 23) + 0xfffu + mant_odd) >> 13;
  zs_u32 o = zs_select(u >= f16_max, big, zs_select(u < (113u << 23), tiny, normal));
  return (zs_u16)(o | (sign >> 16));
}

__device__ __forceinline__ void zs_store(float* p, zs_i64 i, float x) { p[i] = x; }
__device__ __forceinline__ void zs_store(zs_bf16* p, zs_i64 i, float x) { p[i].bits = zs_bf16_bits(x); }
__device__ __forceinline__ void zs_store(zs_f16* p, zs_i64 i, float x) { p[i].bits = zs_f16_bits(x); }
__device__ __forceinline__ void zs_store(zs_none*, zs_i64, float) {}

// Grid-stride loop bounds for the __global__ drivers.
#define ZS_GRID_STRIDE(i, n)                                               \
  for (zs_i64 i = (zs_i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (zs_i64)blockDim.x * gridDim.x)

// ZS_HOST(...) keeps its argument only in the CPU build: the fast host drivers.
// zs_host_for(n, body) runs body(begin, end) over contiguous slices of [0, n),
// one per OpenMP thread, with no thread team for small buffers (starting one
// costs more than the work). Each thread works on its own copy of `body`, so
// captured scalars are locals to the vectoriser, not loads through a pointer.
#ifdef ZS_CPU
#define ZS_HOST(...) __VA_ARGS__
template <typename F>
static inline void zs_host_for(zs_i64 n, const F& body) {
#pragma omp parallel if (n > 65536)
  {
    F local = body;
    zs_i64 nt = omp_get_num_threads(), t = omp_get_thread_num();
    zs_i64 per = (n + nt - 1) / nt;
    zs_i64 begin = t * per < n ? t * per : n;
    zs_i64 end = begin + per < n ? begin + per : n;
    local(begin, end);
  }
}
#else
#define ZS_HOST(...)
#endif
