// Fused Adam / AdamW: one pass over (param, grad, exp_avg, exp_avg_sq), with
// the loss-scale unscale, the global-norm clip, the inf/nan skip and an
// optional 16-bit copy of the new params folded in.
//
// Host-side scalars (computed in float64 by the caller, as torch does):
//   omb1 = 1 - beta1, omb2 = 1 - beta2, step_size = lr / (1 - beta1^t),
//   bc2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr * wd (AdamW) or 1 (Adam),
//   l2 = wd (Adam's L2 form) or 0 (AdamW).
// sumsq, grad_scale and max_norm: unscale, clip and skip (see optim.cuh).
#include "optim.cuh"

struct AdamScalars {
  float beta1, beta2, omb1, omb2, step_size, bc2_sqrt, eps, decay, l2, gmul;
  bool lerp_low;  // torch.lerp's formula switches at weight 0.5
};

template <typename G, typename H>
__device__ __forceinline__ void adam_elem(float* __restrict__ p, const G* __restrict__ g,
                                          float* __restrict__ m, float* __restrict__ v,
                                          H* __restrict__ copy, zs_i64 i,
                                          const AdamScalars& a) {
  float gi = zs_to_f32(g[i]) * a.gmul;
  float pi = p[i];
  gi = fmaf(pi, a.l2, gi);  // Adam: grad += wd * param (0 for AdamW)
  pi = pi * a.decay;     // AdamW: param *= 1 - lr * wd
  float mi = m[i];
  // exp_avg.lerp_(grad, 1 - beta1) as torch's CPU kernels compute it: one fma,
  // with torch.lerp's two formulas (weight below or above 0.5), selected on
  // bits because a float ternary here left the loop unvectorised.
  float d = gi - mi;
  mi = __uint_as_float(zs_select(a.lerp_low, __float_as_uint(fmaf(a.omb1, d, mi)),
                                 __float_as_uint(fmaf(a.omb1 - 1.0f, d, gi))));
  float vi = fmaf(a.omb2 * gi, gi, v[i] * a.beta2);  // mul_(beta2).addcmul_(g, g, 1 - beta2)
  float denom = sqrtf(vi) / a.bc2_sqrt + a.eps;
  pi = pi + (-a.step_size * mi) / denom;  // addcdiv_(m, denom, value=-step_size)
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  zs_store(copy, i, pi);
}

#ifdef ZS_CPU
// The host driver's inner loop, in a function of its own so that the pointers
// keep their __restrict__ (a lambda capture would drop it and with it the SIMD).
template <typename G, typename H>
static void adam_host_slice(float* __restrict__ p, const G* __restrict__ g,
                            float* __restrict__ m, float* __restrict__ v,
                            H* __restrict__ copy, zs_i64 begin, zs_i64 end,
                            const AdamScalars a) {
#pragma omp simd
  for (zs_i64 i = begin; i < end; ++i) adam_elem(p, g, m, v, copy, i, a);
}

// Out of place, in the same one pass: the old param and moments are read from
// p0, m0, v0 and the new ones written to p, m, v (whose contents are not read),
// with the same adam_elem, so the result is the in-place update's, bit for
// bit. The host tier's overlapped update writes a spare set this way.
template <typename G, typename H>
static void adam_host_slice_from(const float* __restrict__ p0, const float* __restrict__ m0,
                                 const float* __restrict__ v0, float* __restrict__ p,
                                 const G* __restrict__ g, float* __restrict__ m,
                                 float* __restrict__ v, H* __restrict__ copy, zs_i64 begin,
                                 zs_i64 end, const AdamScalars a) {
#pragma omp simd
  for (zs_i64 i = begin; i < end; ++i) {
    p[i] = p0[i];
    m[i] = m0[i];
    v[i] = v0[i];
    adam_elem(p, g, m, v, copy, i, a);
  }
}
#endif

#ifdef ZS_CPU
// Many tensors in one thread team (zs_host_tensors); ptrs holds (p, g, m, v,
// copy) for each tensor.
template <typename G, typename H>
static void adam_host_multi(const zs_i64* ptrs, const zs_i64* sizes, zs_i64 ntensors,
                            const AdamScalars a) {
  zs_host_tensors(sizes, ntensors, [=](zs_i64 k, zs_i64 lo, zs_i64 hi) {
    const zs_i64* q = ptrs + 5 * k;
    adam_host_slice((float*)q[0], (const G*)q[1], (float*)q[2], (float*)q[3], (H*)q[4], lo, hi,
                    a);
  });
}
#endif

// Many tensors in one launch (as torch's multi_tensor_apply): the tensors'
// index spaces are concatenated, `starts` holds each tensor's first index in
// it (ntensors + 1 entries, the last one the total) and `ptrs` the five
// pointers (p, g, m, v, copy) of each tensor. A grid-stride thread walks its
// indices upwards, so it finds each next tensor by stepping forward, and keeps
// the current tensor's pointers in registers.
template <typename G, typename H>
__device__ __forceinline__ void adam_table(const zs_i64* __restrict__ ptrs,
                                           const zs_i64* __restrict__ starts,
                                           zs_i64 ntensors, const AdamScalars& a) {
  zs_i64 k = 0, lo = 0, hi = 0;
  float* p = 0;
  const G* g = 0;
  float *m = 0, *v = 0;
  H* copy = 0;
  ZS_GRID_STRIDE(i, starts[ntensors]) {
    if (i >= hi) {
      while (i >= starts[k + 1]) ++k;
      lo = starts[k];
      hi = starts[k + 1];
      const zs_i64* q = ptrs + 5 * k;
      p = (float*)q[0];
      g = (const G*)q[1];
      m = (float*)q[2];
      v = (float*)q[3];
      copy = (H*)q[4];
    }
    adam_elem(p, g, m, v, copy, i - lo, a);
  }
}

#define ZS_ADAM_PROLOGUE                                                         \
  AdamScalars a = {beta1, beta2, omb1, omb2, step_size, bc2_sqrt, eps,           \
                   decay, l2, 1.0f, omb1 < 0.5f};                                \
  if (!zs_grad_prologue(sumsq, grad_scale, max_norm, &a.gmul)) return;

#define ZS_ADAM_ENTRY(SUFFIX, G, H)                                              \
  extern "C" __global__ void __launch_bounds__(256)                             \
      zs_adam_##SUFFIX(ZS_ADAM_PARAMS(G, H)) {                                   \
    ZS_ADAM_PROLOGUE                                                             \
    ZS_GRID_STRIDE(i, n) adam_elem(p, g, m, v, copy, i, a);                      \
  }                                                                              \
  extern "C" __global__ void __launch_bounds__(256)                             \
      zs_adam_multi_##SUFFIX(ZS_ADAM_TABLE_PARAMS) {                             \
    ZS_ADAM_PROLOGUE                                                             \
    adam_table<G, H>(ptrs, starts, n, a);                                        \
  }                                                                              \
  ZS_HOST(extern "C" void zs_adam_##SUFFIX##_host(ZS_ADAM_PARAMS(G, H)) {        \
    ZS_ADAM_PROLOGUE                                                             \
    zs_host_for(n, [=](zs_i64 begin, zs_i64 end) {                             \
      adam_host_slice(p, g, m, v, copy, begin, end, a);                          \
    });                                                                          \
  }                                                                              \
  extern "C" void zs_adam_##SUFFIX##_multi_host(ZS_ADAM_MULTI_PARAMS) {          \
    ZS_ADAM_PROLOGUE                                                             \
    adam_host_multi<G, H>(ptrs, sizes, n, a);                                    \
  }                                                                              \
  extern "C" void zs_adam_##SUFFIX##_from_host(                                  \
      const float *__restrict__ p0, const float *__restrict__ m0,                \
      const float *__restrict__ v0, ZS_ADAM_PARAMS(G, H)) {                      \
    ZS_ADAM_PROLOGUE                                                             \
    zs_host_for(n, [=](zs_i64 begin, zs_i64 end) {                             \
      adam_host_slice_from(p0, m0, v0, p, g, m, v, copy, begin, end, a);         \
    });                                                                          \
  })

ZS_ADAM_ENTRY(f32_none, float, zs_none)
ZS_ADAM_ENTRY(f32_bf16, float, zs_bf16)
ZS_ADAM_ENTRY(f32_f16, float, zs_f16)
ZS_ADAM_ENTRY(bf16_none, zs_bf16, zs_none)
ZS_ADAM_ENTRY(bf16_bf16, zs_bf16, zs_bf16)
ZS_ADAM_ENTRY(bf16_f16, zs_bf16, zs_f16)
ZS_ADAM_ENTRY(f16_none, zs_f16, zs_none)
ZS_ADAM_ENTRY(f16_bf16, zs_f16, zs_bf16)
ZS_ADAM_ENTRY(f16_f16, zs_f16, zs_f16)
