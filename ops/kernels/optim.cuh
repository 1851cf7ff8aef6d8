// What the fused optimizer kernels (adam.cu, lion.cu) share: their parameters
// (one ABI, so that every driver, the multi-tensor launch and the emulation
// run each of them alike; ops/kernels/_table.py lists them) and the prologue
// that reads the global sum of squares of the grads on the device.
#pragma once
#include "common.cuh"

// The multiplier of the grads (grad_scale, times the clip coefficient when
// max_norm > 0: torch's clip_grad_norm_, coef = max_norm / (norm + 1e-6)), or
// false where sumsq (nullable) is not finite: an inf/nan somewhere, and the
// whole update is skipped. Reading it on the device keeps a GPU step free of
// host synchronisation.
__device__ __forceinline__ bool zs_grad_prologue(const double* sumsq, float grad_scale,
                                                 float max_norm, float* gmul) {
  float mul = grad_scale;
  if (sumsq != 0) {
    double s = *sumsq;
    if (!zs_isfinite(s)) return false;
    if (max_norm > 0.0f) {
      double coef = (double)max_norm / (sqrt(s) * (double)grad_scale + 1e-6);
      if (coef < 1.0) mul = (float)((double)grad_scale * coef);
    }
  }
  *gmul = mul;
  return true;
}

#ifdef ZS_CPU
// The multi-tensor host drivers' walk: the tensors' concatenated index space
// is cut into one contiguous range per thread (zs_host_for), each range walked
// tensor by tensor, body(k, lo, hi) called for the part [lo, hi) of tensor k
// in it. Each body calls a slice function of its own, whose __restrict__
// pointers keep the inner loop vectorised.
template <typename F>
static void zs_host_tensors(const zs_i64* sizes, zs_i64 ntensors, const F& body) {
  zs_i64 total = 0;
  for (zs_i64 k = 0; k < ntensors; ++k) total += sizes[k];
  zs_host_for(total, [=](zs_i64 begin, zs_i64 end) {
    zs_i64 start = 0;
    for (zs_i64 k = 0; k < ntensors && start < end; start += sizes[k], ++k) {
      zs_i64 lo = begin > start ? begin - start : 0;
      zs_i64 hi = end - start < sizes[k] ? end - start : sizes[k];
      if (hi > lo) body(k, lo, hi);
    }
  });
}
#endif

#define ZS_ADAM_PARAMS(G, H)                                                     \
  float *__restrict__ p, const G *__restrict__ g, float *__restrict__ m,         \
      float *__restrict__ v, H *__restrict__ copy, zs_i64 n,                    \
      const double *__restrict__ sumsq, float beta1, float beta2, float omb1,    \
      float omb2, float step_size, float bc2_sqrt, float eps, float decay,       \
      float l2, float grad_scale, float max_norm

// The multi-tensor host driver's parameters: n counts tensors here.
#define ZS_ADAM_MULTI_PARAMS                                                     \
  const zs_i64 *__restrict__ ptrs, const zs_i64 *__restrict__ sizes, zs_i64 n,   \
      const double *__restrict__ sumsq, float beta1, float beta2, float omb1,    \
      float omb2, float step_size, float bc2_sqrt, float eps, float decay,       \
      float l2, float grad_scale, float max_norm

// The multi-tensor kernel's parameters: n counts tensors, starts has n + 1.
#define ZS_ADAM_TABLE_PARAMS                                                     \
  const zs_i64 *__restrict__ ptrs, const zs_i64 *__restrict__ starts, zs_i64 n, \
      const double *__restrict__ sumsq, float beta1, float beta2, float omb1,    \
      float omb2, float step_size, float bc2_sqrt, float eps, float decay,       \
      float l2, float grad_scale, float max_norm

