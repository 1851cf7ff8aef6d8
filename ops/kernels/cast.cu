// Elementwise casts between fp32 and the 16-bit formats (round to nearest even).
#include "common.cuh"

#define ZS_CAST_ENTRY(NAME, X, Y)                                                 \
  extern "C" __global__ void __launch_bounds__(256)                              \
      NAME(const X* __restrict__ x, Y* __restrict__ y, zs_i64 n) {              \
    ZS_GRID_STRIDE(i, n) zs_store(y, i, zs_to_f32(x[i]));                         \
  }                                                                               \
  ZS_HOST(extern "C" void NAME##_host(const X* __restrict__ x, Y* __restrict__ y, \
                                      zs_i64 n) {                               \
    zs_host_for(n, [=](zs_i64 begin, zs_i64 end) {                              \
      _Pragma("omp simd") for (zs_i64 i = begin; i < end; ++i)                   \
          zs_store(y, i, zs_to_f32(x[i]));                                        \
    });                                                                           \
  })

ZS_CAST_ENTRY(zs_cast_f32_bf16, float, zs_bf16)
ZS_CAST_ENTRY(zs_cast_f32_f16, float, zs_f16)
ZS_CAST_ENTRY(zs_cast_bf16_f32, zs_bf16, float)
ZS_CAST_ENTRY(zs_cast_f16_f32, zs_f16, float)
