// Fused LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning"),
// as optax.lamb computes it, with the loss-scale unscale, the global-norm clip,
// the inf/nan skip and an optional 16-bit copy of the new params folded in:
//   m = b1 * m + (1 - b1) * g,  v = b2 * v + (1 - b2) * g^2,
//   u = (m * inv_bc1) / (sqrt(v * inv_bc2 + eps_root) + eps) + wd * p,
//   r = |p| / |u| per tensor (1 where either is 0; clamped to
//       [trust_min, trust_max] when trust_max > 0, as DeepSpeed's FusedLamb),
//   p = p + (-lr * r) * u.
// The ratio needs each whole tensor's norms before any param may change, so
// the update is two passes: "stats" updates m and v and sums u^2 and p^2 per
// tensor (24 bytes per fp32 param), "apply" recomputes u from the new m, v and
// the unchanged p and writes p (16 bytes): 40 bytes against Adam's 28. Between
// them the caller may sum the per-tensor sums over ranks (a tensor split over
// ZeRO's data ranks), which is why they are two launches and not one.
//
// [Note: LAMB's sums, bit for bit]
// The per-tensor sums decide every param, so the CPU build computes them in
// exactly the GPU's order: each tensor is cut into chunks of ZS_LAMB_CHUNK
// elements; in a chunk, lane t of a 256-lane block sums elements t, t + 256,
// ... (16 at most) in float32, the 256 lane sums are added in float64 by the
// block's shuffle tree (zs_tree256 on the CPU replays it), and a tensor's
// chunk sums are added in chunk order (lamb_finish_one, shared). The CPU
// build runs chunks in parallel with SIMD over the lanes; the GPU one block
// per chunk. (float64 lane sums cost the CPU build a fifth of its speed, and
// 16 float32 additions keep a sum within 1e-6 of the exact one.)
#include "optim.cuh"

#define ZS_LAMB_BLOCK 256  // launchers must use exactly this block size
#define ZS_LAMB_CHUNK 4096

struct LambScalars {
  float beta1, beta2, omb1, omb2, inv_bc1, inv_bc2, eps, eps_root, wd, lr, trust_min, trust_max;
  float gmul;
};

// u for one element, from the (new) moments and the (old) param. The bias
// corrections multiply by their reciprocals (formed in float64 on the host):
// a division and a square root per element are what keep the CPU build at
// memory speed (optax divides, within an ulp of this).
__device__ __forceinline__ float lamb_u(float pi, float mi, float vi, const LambScalars& a) {
  float mh = mi * a.inv_bc1;
  float vh = vi * a.inv_bc2;
  float u = mh / (sqrtf(vh + a.eps_root) + a.eps);
  return u + a.wd * pi;
}

// Pass 1 for one element: the moments updated in place, u^2 and p^2 added to
// the lane's sums.
template <typename G>
__device__ __forceinline__ void lamb_stats_elem(const float* __restrict__ p,
                                                const G* __restrict__ g, float* __restrict__ m,
                                                float* __restrict__ v, zs_i64 i,
                                                const LambScalars& a, float* su, float* sp) {
  float gi = zs_to_f32(g[i]) * a.gmul;
  float mi = a.omb1 * gi + a.beta1 * m[i];
  float vi = a.omb2 * (gi * gi) + a.beta2 * v[i];
  m[i] = mi;
  v[i] = vi;
  float pi = p[i];
  float u = lamb_u(pi, mi, vi, a);
  *su += u * u;
  *sp += pi * pi;
}

// A tensor's step, -lr times its trust ratio, from its sums of squares (u^2, p^2).
__device__ __forceinline__ float lamb_step(const double* __restrict__ sums, zs_i64 k,
                                            const LambScalars& a) {
  double un = sqrt(sums[2 * k]), pn = sqrt(sums[2 * k + 1]);
  double r = 1.0;
  if (pn != 0.0 && un != 0.0) {
    r = pn / un;
    if (a.trust_max > 0.0f) {
      if (r < (double)a.trust_min) r = (double)a.trust_min;
      if (r > (double)a.trust_max) r = (double)a.trust_max;
    }
  }
  return (float)(-(double)a.lr * r);
}

// Pass 2 for one element: p = p + step * u with the tensor's step -lr * r, and
// the 16-bit copy.
template <typename H>
__device__ __forceinline__ void lamb_apply_elem(float* __restrict__ p,
                                                const float* __restrict__ m,
                                                const float* __restrict__ v, H* __restrict__ copy,
                                                zs_i64 i, const LambScalars& a, float step) {
  float pi = p[i];
  float u = lamb_u(pi, m[i], v[i], a);
  pi = pi + step * u;
  p[i] = pi;
  zs_store(copy, i, pi);
}

// A tensor's sums: its chunks' partials added in chunk order (GPU and CPU).
__device__ __forceinline__ void lamb_finish_one(const zs_i64* __restrict__ chunks,
                                                const double* __restrict__ partials, zs_i64 k,
                                                double* __restrict__ sums) {
  double su = 0.0, sp = 0.0;
  for (zs_i64 c = chunks[k]; c < chunks[k + 1]; ++c) {
    su += partials[2 * c];
    sp += partials[2 * c + 1];
  }
  sums[2 * k] = su;
  sums[2 * k + 1] = sp;
}

// The sums of `a` and `b` over a 256-thread block (valid in thread 0), as
// reduce.cu's zs_block_sum: shuffles down within each warp, then warp 0 over
// the warps' sums. Safe to call again in the same kernel (it syncs first).
__device__ __forceinline__ void zs_block_sum2(double* a, double* b) {
  __shared__ double warp_sums[2 * (ZS_LAMB_BLOCK / 32)];
  double x = *a, y = *b;
  for (int off = 16; off > 0; off >>= 1) {
    x += __shfl_down_sync(0xffffffffu, x, off);
    y += __shfl_down_sync(0xffffffffu, y, off);
  }
  unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // a previous call's readers are done with warp_sums
  if (lane == 0) {
    warp_sums[2 * warp] = x;
    warp_sums[2 * warp + 1] = y;
  }
  __syncthreads();
  x = 0.0;
  y = 0.0;
  if (warp == 0) {
    if (lane < blockDim.x / 32) {
      x = warp_sums[2 * lane];
      y = warp_sums[2 * lane + 1];
    }
    for (int off = 16; off > 0; off >>= 1) {
      x += __shfl_down_sync(0xffffffffu, x, off);
      y += __shfl_down_sync(0xffffffffu, y, off);
    }
  }
  *a = x;
  *b = y;
}

#ifdef ZS_CPU
#include <algorithm>
#include <vector>

// zs_block_sum2's additions for one value, in its order: lane 0's shuffle
// tree within each warp, then over the warps' sums (lanes past them 0.0).
static double zs_tree256(double* lanes) {
  double warps[32] = {0.0};
  for (int w = 0; w < ZS_LAMB_BLOCK / 32; ++w) {
    double* x = lanes + 32 * w;
    for (int off = 16; off > 0; off >>= 1)
      for (int l = 0; l < off; ++l) x[l] += x[l + off];
    warps[w] = x[0];
  }
  for (int off = 16; off > 0; off >>= 1)
    for (int l = 0; l < off; ++l) warps[l] += warps[l + off];
  return warps[0];
}

// Pass 1 over one chunk [lo, hi) of a tensor, lane by lane as a GPU block:
// each lane's float32 sums, then the block's float64 tree.
template <typename G>
static void lamb_stats_chunk(const float* __restrict__ p, const G* __restrict__ g,
                             float* __restrict__ m, float* __restrict__ v, zs_i64 lo, zs_i64 hi,
                             const LambScalars a, double* out) {
  float su[ZS_LAMB_BLOCK] = {0.0f}, sp[ZS_LAMB_BLOCK] = {0.0f};
  for (zs_i64 base = lo; base < hi; base += ZS_LAMB_BLOCK) {
    zs_i64 count = hi - base < ZS_LAMB_BLOCK ? hi - base : ZS_LAMB_BLOCK;
#pragma omp simd
    for (zs_i64 t = 0; t < count; ++t) lamb_stats_elem(p, g, m, v, base + t, a, &su[t], &sp[t]);
  }
  double du[ZS_LAMB_BLOCK], dp[ZS_LAMB_BLOCK];
  for (int t = 0; t < ZS_LAMB_BLOCK; ++t) {
    du[t] = su[t];
    dp[t] = sp[t];
  }
  out[0] = zs_tree256(du);
  out[1] = zs_tree256(dp);
}

// Pass 1 over many tensors (ptrs: (p, g, m, v, copy) each), then each
// tensor's sums into sums[2k], sums[2k + 1].
template <typename G>
static void lamb_stats_host(const zs_i64* ptrs, const zs_i64* sizes, zs_i64 ntensors,
                            const LambScalars a, double* sums) {
  std::vector<zs_i64> chunks(ntensors + 1, 0);
  for (zs_i64 k = 0; k < ntensors; ++k)
    chunks[k + 1] = chunks[k] + (sizes[k] + ZS_LAMB_CHUNK - 1) / ZS_LAMB_CHUNK;
  zs_i64 nchunks = chunks[ntensors];
  std::vector<double> partials(2 * nchunks);
#pragma omp parallel for schedule(static) if (nchunks > 16)
  for (zs_i64 c = 0; c < nchunks; ++c) {
    zs_i64 k = std::upper_bound(chunks.begin(), chunks.end(), c) - chunks.begin() - 1;
    zs_i64 lo = (c - chunks[k]) * ZS_LAMB_CHUNK;
    zs_i64 hi = lo + ZS_LAMB_CHUNK < sizes[k] ? lo + ZS_LAMB_CHUNK : sizes[k];
    const zs_i64* q = ptrs + 5 * k;
    lamb_stats_chunk((const float*)q[0], (const G*)q[1], (float*)q[2], (float*)q[3], lo, hi, a,
                     &partials[2 * c]);
  }
  for (zs_i64 k = 0; k < ntensors; ++k) lamb_finish_one(chunks.data(), partials.data(), k, sums);
}

template <typename H>
static void lamb_apply_slice(float* __restrict__ p, const float* __restrict__ m,
                             const float* __restrict__ v, H* __restrict__ copy, zs_i64 begin,
                             zs_i64 end, const LambScalars a, float step) {
#pragma omp simd
  for (zs_i64 i = begin; i < end; ++i) lamb_apply_elem(p, m, v, copy, i, a, step);
}

// Pass 2 over many tensors in one thread team (zs_host_tensors).
template <typename H>
static void lamb_apply_host(const zs_i64* ptrs, const zs_i64* sizes, zs_i64 ntensors,
                            const LambScalars a, const double* sums) {
  zs_host_tensors(sizes, ntensors, [=](zs_i64 k, zs_i64 lo, zs_i64 hi) {
    const zs_i64* q = ptrs + 5 * k;
    lamb_apply_slice((float*)q[0], (const float*)q[2], (const float*)q[3], (H*)q[4], lo, hi, a,
                     lamb_step(sums, k, a));
  });
}
#endif

// Pass 1 on the GPU: block b takes chunks b, b + gridDim.x, ...; `chunks`
// holds each tensor's first chunk (ntensors + 1 entries), `starts` its first
// element (the same for elements), `ptrs` (p, g, m, v, copy) per tensor.
template <typename G>
__device__ __forceinline__ void lamb_stats_table(const zs_i64* __restrict__ ptrs,
                                                 const zs_i64* __restrict__ starts,
                                                 const zs_i64* __restrict__ chunks,
                                                 zs_i64 ntensors, const LambScalars& a,
                                                 double* __restrict__ partials) {
  zs_i64 k = 0;
  for (zs_i64 c = blockIdx.x; c < chunks[ntensors]; c += gridDim.x) {
    while (c >= chunks[k + 1]) ++k;
    zs_i64 lo = (c - chunks[k]) * ZS_LAMB_CHUNK, size = starts[k + 1] - starts[k];
    zs_i64 hi = lo + ZS_LAMB_CHUNK < size ? lo + ZS_LAMB_CHUNK : size;
    const zs_i64* q = ptrs + 5 * k;
    const float* p = (const float*)q[0];
    const G* g = (const G*)q[1];
    float* m = (float*)q[2];
    float* v = (float*)q[3];
    float fu = 0.0f, fp = 0.0f;
    for (zs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x)
      lamb_stats_elem(p, g, m, v, i, a, &fu, &fp);
    double su = fu, sp = fp;
    zs_block_sum2(&su, &sp);
    if (threadIdx.x == 0) {
      partials[2 * c] = su;
      partials[2 * c + 1] = sp;
    }
  }
}

// Pass 2 on the GPU: a grid-stride walk of the concatenated index space, as
// adam_table, with the tensor's step computed when a thread enters it.
template <typename H>
__device__ __forceinline__ void lamb_apply_table(const zs_i64* __restrict__ ptrs,
                                                 const zs_i64* __restrict__ starts,
                                                 zs_i64 ntensors, const LambScalars& a,
                                                 const double* __restrict__ sums) {
  zs_i64 k = 0, lo = 0, hi = 0;
  float* p = 0;
  const float *m = 0, *v = 0;
  H* copy = 0;
  float step = 0.0f;
  ZS_GRID_STRIDE(i, starts[ntensors]) {
    if (i >= hi) {
      while (i >= starts[k + 1]) ++k;
      lo = starts[k];
      hi = starts[k + 1];
      const zs_i64* q = ptrs + 5 * k;
      p = (float*)q[0];
      m = (const float*)q[2];
      v = (const float*)q[3];
      copy = (H*)q[4];
      step = lamb_step(sums, k, a);
    }
    lamb_apply_elem(p, m, v, copy, i - lo, a, step);
  }
}

#define ZS_LAMB_SCALARS                                                          \
  const double *__restrict__ sumsq, float beta1, float beta2, float omb1,        \
      float omb2, float inv_bc1, float inv_bc2, float eps, float eps_root,       \
      float wd, float lr, float trust_min, float trust_max, float grad_scale,    \
      float max_norm

#define ZS_LAMB_PROLOGUE                                                         \
  LambScalars a = {beta1,    beta2, omb1, omb2,      inv_bc1,   inv_bc2, eps,   \
                   eps_root, wd,    lr,   trust_min, trust_max, 1.0f};          \
  if (!zs_grad_prologue(sumsq, grad_scale, max_norm, &a.gmul)) return;

#define ZS_LAMB_STATS_ENTRY(SUFFIX, G)                                           \
  extern "C" __global__ void __launch_bounds__(ZS_LAMB_BLOCK)                   \
      zs_lamb_stats_##SUFFIX(const zs_i64* __restrict__ ptrs,                    \
                             const zs_i64* __restrict__ starts,                  \
                             const zs_i64* __restrict__ chunks, zs_i64 n,        \
                             ZS_LAMB_SCALARS, double* __restrict__ partials) {   \
    ZS_LAMB_PROLOGUE                                                             \
    lamb_stats_table<G>(ptrs, starts, chunks, n, a, partials);                   \
  }                                                                              \
  ZS_HOST(extern "C" void zs_lamb_stats_##SUFFIX##_host(                         \
      const zs_i64* __restrict__ ptrs, const zs_i64* __restrict__ sizes,         \
      zs_i64 n, ZS_LAMB_SCALARS, double* __restrict__ sums) {                    \
    ZS_LAMB_PROLOGUE                                                             \
    lamb_stats_host<G>(ptrs, sizes, n, a, sums);                                 \
  })

#define ZS_LAMB_APPLY_ENTRY(SUFFIX, H)                                           \
  extern "C" __global__ void __launch_bounds__(ZS_LAMB_BLOCK)                   \
      zs_lamb_apply_##SUFFIX(const zs_i64* __restrict__ ptrs,                    \
                             const zs_i64* __restrict__ starts, zs_i64 n,        \
                             ZS_LAMB_SCALARS, const double* __restrict__ sums) { \
    ZS_LAMB_PROLOGUE                                                             \
    lamb_apply_table<H>(ptrs, starts, n, a, sums);                               \
  }                                                                              \
  ZS_HOST(extern "C" void zs_lamb_apply_##SUFFIX##_host(                         \
      const zs_i64* __restrict__ ptrs, const zs_i64* __restrict__ sizes,         \
      zs_i64 n, ZS_LAMB_SCALARS, const double* __restrict__ sums) {              \
    ZS_LAMB_PROLOGUE                                                             \
    lamb_apply_host<H>(ptrs, sizes, n, a, sums);                                 \
  })

ZS_LAMB_STATS_ENTRY(f32, float)
ZS_LAMB_STATS_ENTRY(bf16, zs_bf16)
ZS_LAMB_STATS_ENTRY(f16, zs_f16)
ZS_LAMB_APPLY_ENTRY(none, zs_none)
ZS_LAMB_APPLY_ENTRY(bf16, zs_bf16)
ZS_LAMB_APPLY_ENTRY(f16, zs_f16)

// Each tensor's sums from pass 1's chunk partials: one thread per tensor.
extern "C" __global__ void __launch_bounds__(ZS_LAMB_BLOCK)
    zs_lamb_finish(const zs_i64* __restrict__ chunks, zs_i64 n,
                   const double* __restrict__ partials, double* __restrict__ sums) {
  ZS_GRID_STRIDE(k, n) lamb_finish_one(chunks, partials, k, sums);
}
