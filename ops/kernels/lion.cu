// Fused Lion (Chen et al., 2023, "Symbolic Discovery of Optimization
// Algorithms"), as optax.lion computes it, in one pass over (param, grad,
// exp_avg) with the loss-scale unscale, the global-norm clip, the inf/nan skip
// and an optional 16-bit copy of the new params folded in:
//   c = b1 * m + (1 - b1) * g,  p = p - lr * (sign(c) + wd * p),
//   m = b2 * m + (1 - b2) * g.
// It takes the Adam kernels' parameters (ops/kernels/_table.py), so that every
// driver, the multi-tensor launch and the emulation run it unchanged: v,
// bc2_sqrt, eps and l2 are unused, step_size is lr and decay is wd.
#include "optim.cuh"

struct LionScalars {
  float beta1, beta2, omb1, omb2, lr, wd, gmul;
};

template <typename G, typename H>
__device__ __forceinline__ void lion_elem(float* __restrict__ p, const G* __restrict__ g,
                                          float* __restrict__ m, H* __restrict__ copy,
                                          zs_i64 i, const LionScalars& a) {
  float gi = zs_to_f32(g[i]) * a.gmul;
  float mi = m[i];
  float c = a.beta1 * mi + a.omb1 * gi;
  // sign(c) as arithmetic (0 at 0), so the loop stays branch-free and vectorised
  float s = (float)(c > 0.0f) - (float)(c < 0.0f);
  float pi = p[i];
  pi = pi + -a.lr * (s + a.wd * pi);
  p[i] = pi;
  m[i] = a.beta2 * mi + a.omb2 * gi;
  zs_store(copy, i, pi);
}

#ifdef ZS_CPU
template <typename G, typename H>
static void lion_host_slice(float* __restrict__ p, const G* __restrict__ g,
                            float* __restrict__ m, H* __restrict__ copy, zs_i64 begin,
                            zs_i64 end, const LionScalars a) {
#pragma omp simd
  for (zs_i64 i = begin; i < end; ++i) lion_elem(p, g, m, copy, i, a);
}

// Many tensors in one thread team (zs_host_tensors): ptrs holds (p, g, m, v,
// copy) for each tensor, v unused.
template <typename G, typename H>
static void lion_host_multi(const zs_i64* ptrs, const zs_i64* sizes, zs_i64 ntensors,
                            const LionScalars a) {
  zs_host_tensors(sizes, ntensors, [=](zs_i64 k, zs_i64 lo, zs_i64 hi) {
    const zs_i64* q = ptrs + 5 * k;
    lion_host_slice((float*)q[0], (const G*)q[1], (float*)q[2], (H*)q[4], lo, hi, a);
  });
}
#endif

// Many tensors in one launch, as adam_table (see adam.cu).
template <typename G, typename H>
__device__ __forceinline__ void lion_table(const zs_i64* __restrict__ ptrs,
                                           const zs_i64* __restrict__ starts,
                                           zs_i64 ntensors, const LionScalars& a) {
  zs_i64 k = 0, lo = 0, hi = 0;
  float* p = 0;
  const G* g = 0;
  float* m = 0;
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
      copy = (H*)q[4];
    }
    lion_elem(p, g, m, copy, i - lo, a);
  }
}

#define ZS_LION_PROLOGUE                                                         \
  (void)v;                                                                       \
  (void)bc2_sqrt;                                                                \
  (void)eps;                                                                     \
  (void)l2;                                                                      \
  LionScalars a = {beta1, beta2, omb1, omb2, step_size, decay, 1.0f};           \
  if (!zs_grad_prologue(sumsq, grad_scale, max_norm, &a.gmul)) return;

#define ZS_LION_TABLE_PROLOGUE                                                   \
  (void)bc2_sqrt;                                                                \
  (void)eps;                                                                     \
  (void)l2;                                                                      \
  LionScalars a = {beta1, beta2, omb1, omb2, step_size, decay, 1.0f};           \
  if (!zs_grad_prologue(sumsq, grad_scale, max_norm, &a.gmul)) return;

#define ZS_LION_ENTRY(SUFFIX, G, H)                                              \
  extern "C" __global__ void __launch_bounds__(256)                             \
      zs_lion_##SUFFIX(ZS_ADAM_PARAMS(G, H)) {                                   \
    ZS_LION_PROLOGUE                                                             \
    ZS_GRID_STRIDE(i, n) lion_elem(p, g, m, copy, i, a);                         \
  }                                                                              \
  extern "C" __global__ void __launch_bounds__(256)                             \
      zs_lion_multi_##SUFFIX(ZS_ADAM_TABLE_PARAMS) {                             \
    ZS_LION_TABLE_PROLOGUE                                                       \
    lion_table<G, H>(ptrs, starts, n, a);                                        \
  }                                                                              \
  ZS_HOST(extern "C" void zs_lion_##SUFFIX##_host(ZS_ADAM_PARAMS(G, H)) {        \
    ZS_LION_PROLOGUE                                                             \
    zs_host_for(n, [=](zs_i64 begin, zs_i64 end) {                             \
      lion_host_slice(p, g, m, copy, begin, end, a);                             \
    });                                                                          \
  }                                                                              \
  extern "C" void zs_lion_##SUFFIX##_multi_host(ZS_ADAM_MULTI_PARAMS) {          \
    ZS_LION_TABLE_PROLOGUE                                                       \
    lion_host_multi<G, H>(ptrs, sizes, n, a);                                    \
  })

ZS_LION_ENTRY(f32_none, float, zs_none)
ZS_LION_ENTRY(f32_bf16, float, zs_bf16)
ZS_LION_ENTRY(f32_f16, float, zs_f16)
ZS_LION_ENTRY(bf16_none, zs_bf16, zs_none)
ZS_LION_ENTRY(bf16_bf16, zs_bf16, zs_bf16)
ZS_LION_ENTRY(bf16_f16, zs_bf16, zs_f16)
ZS_LION_ENTRY(f16_none, zs_f16, zs_none)
ZS_LION_ENTRY(f16_bf16, zs_f16, zs_bf16)
ZS_LION_ENTRY(f16_f16, zs_f16, zs_f16)
