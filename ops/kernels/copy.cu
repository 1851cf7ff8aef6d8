// Many runs of elements copied in one launch: a ZeRO-3 unit's leaves out of its
// all-gathered (W, S) sections into one flat buffer, and a unit's gradients
// into the (W, S) layout its reduce-scatter takes (see [Note: unit buffers]).
//
// Run k covers starts[k] <= i < starts[k + 1] of the concatenated index space
// (nruns + 1 entries, the last one the total). Its destination is
// dst + runs[2k + 1]; its source is src + runs[2k] where src is given, else the
// absolute address runs[2k] (each run a tensor of its own); a run whose source
// address is 0 writes zeros (padding rows). A grid-stride thread walks its
// indices upwards, so it finds each next run by stepping forward.
#include "common.cuh"

// An element as it is stored in the destination: raw copies keep the bits
// (any dtype of that size), 16-bit floats widen to float32.
template <typename T>
__device__ __forceinline__ T zs_convert(T x) { return x; }
__device__ __forceinline__ float zs_convert(zs_bf16 x) { return zs_to_f32(x); }
__device__ __forceinline__ float zs_convert(zs_f16 x) { return zs_to_f32(x); }

template <typename S, typename D>
__device__ __forceinline__ void copy_runs(const S* __restrict__ src, D* __restrict__ dst,
                                          const zs_i64* __restrict__ runs,
                                          const zs_i64* __restrict__ starts, zs_i64 nruns) {
  zs_i64 k = 0, lo = 0, hi = 0;
  const S* from = 0;
  D* to = 0;
  ZS_GRID_STRIDE(i, starts[nruns]) {
    if (i >= hi) {
      while (i >= starts[k + 1]) ++k;
      lo = starts[k];
      hi = starts[k + 1];
      from = src ? src + runs[2 * k] : (const S*)runs[2 * k];
      to = dst + runs[2 * k + 1];
    }
    to[i - lo] = from ? (D)zs_convert(from[i - lo]) : (D)0;
  }
}

#ifdef ZS_CPU
// The host drivers: one contiguous range of the index space per thread, walked
// run by run; each run a vectorisable loop.
template <typename S, typename D>
static void host_runs(const S* src, D* dst, const zs_i64* runs, const zs_i64* starts,
                      zs_i64 nruns) {
  zs_host_for(starts[nruns], [=](zs_i64 begin, zs_i64 end) {
    for (zs_i64 k = 0; k < nruns && starts[k] < end; ++k) {
      zs_i64 lo = begin > starts[k] ? begin : starts[k];
      zs_i64 hi = end < starts[k + 1] ? end : starts[k + 1];
      if (hi <= lo) continue;
      const S* from = src ? src + runs[2 * k] : (const S*)runs[2 * k];
      D* to = dst + runs[2 * k + 1] - starts[k];
      if (from) {
        from -= starts[k];
#pragma omp simd
        for (zs_i64 i = lo; i < hi; ++i) to[i] = (D)zs_convert(from[i]);
      } else {
#pragma omp simd
        for (zs_i64 i = lo; i < hi; ++i) to[i] = (D)0;
      }
    }
  });
}
#endif

#define ZS_RUNS_PARAMS(S, D)                                                       \
  const S *__restrict__ src, D *__restrict__ dst, const zs_i64 *__restrict__ runs, \
      const zs_i64 *__restrict__ starts, zs_i64 nruns

#define ZS_RUNS_ENTRY(NAME, S, D)                                                   \
  extern "C" __global__ void __launch_bounds__(256) NAME(ZS_RUNS_PARAMS(S, D)) {    \
    copy_runs<S, D>(src, dst, runs, starts, nruns);                                \
  }                                                                                \
  ZS_HOST(extern "C" void NAME##_host(ZS_RUNS_PARAMS(S, D)) {                      \
    host_runs<S, D>(src, dst, runs, starts, nruns);                                \
  })

ZS_RUNS_ENTRY(zs_copy_runs_b2, zs_u16, zs_u16)
ZS_RUNS_ENTRY(zs_copy_runs_b4, zs_u32, zs_u32)
ZS_RUNS_ENTRY(zs_copy_runs_b8, zs_i64, zs_i64)
ZS_RUNS_ENTRY(zs_widen_runs_bf16, zs_bf16, float)
ZS_RUNS_ENTRY(zs_widen_runs_f16, zs_f16, float)
