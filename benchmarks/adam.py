"""Optimizer step benchmark: ops.fused_adam_step against torch, optax and
DeepSpeed, and ops.fused_lion and ops.fused_lamb against optax.

Every implementation runs in this one process, one after another on freshly
allocated buffers of the same sizes, and the table reports the median step time
with ratios to torch's fused CPU Adam and to the memory-bandwidth floor (with
--rounds, the median over rounds of each round's ratio).

Rows:
  floor          a one-pass stream with Adam's traffic (read p, g, m, v; write
                 p, m, v: 28 bytes/param) and no math: the bandwidth bound.
  ours           ops.fused_adam_multi, fp32 grads (all tensors in one call).
  torch fused    torch.optim.AdamW(fused=True).
  torch foreach  torch.optim.AdamW(foreach=True).
  optax          optax.adamw under jax.jit with donated params and state.
  deepspeed      DeepSpeedCPUAdam (AdamW mode), when deepspeed is importable.
  ours phase     the whole optimizer phase of a mixed-precision step, fused:
                 sum of squares of the grads (clip norm and inf/nan flag), then
                 one pass doing unscale, clip, skip-on-overflow, AdamW and the
                 bf16 copy of the new params for the next all-gather.
  torch phase    the same phase as torch runs it: GradScaler's
                 unscale (_amp_foreach_non_finite_check_and_unscale_),
                 clip_grad_norm_, fused AdamW, and a bf16 copy of the params.
  lion floor     Lion's traffic (read p, g, m; write p, m: 20 bytes/param).
  ours lion      ops.fused_lion (ops/kernels/lion.cu), fp32 grads, all tensors
                 in one call; its "x floor" is against the lion floor.
  optax lion     optax.lion under jax.jit with donated params and state (torch
                 ships no Lion).
  lamb floor     LAMB's traffic in its two passes, every tensor's first pass
                 before any second one, as a step must when the per-tensor norms
                 are summed over ranks in between (read p, g, m, v, write m, v;
                 then read p, m, v, write p: 40 bytes/param; one pass would
                 need the norms before they exist).
  ours lamb      ops.fused_lamb (ops/kernels/lamb.cu), fp32 grads, all tensors in
                 one call per pass; its "x floor" is against the lamb floor.
  optax lamb     optax.lamb under jax.jit with donated params and state (torch
                 ships no LAMB).

Usage: python benchmarks/adam.py [--sizes 10e6 50e6 200e6] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

THREADS = int(os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1)))

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, installed or not
import ops  # noqa: E402
from ops.kernels._build import load_cpu_source  # noqa: E402

LR, WD, MAX_NORM, LOSS_SCALE = 1e-3, 0.01, 1.0, 1.0
STREAM_SRC = r"""
#include <cstdint>
extern "C" void stream28(float* __restrict__ p, const float* __restrict__ g,
                         float* __restrict__ m, float* __restrict__ v, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i], mi = m[i] + gi, vi = v[i] + gi;
    m[i] = mi; v[i] = vi; p[i] += mi + vi;
  }
}
"""


def tensor_sizes(n: int, layout: str, k: int = 100, seed: int = 0) -> list[int]:
    """One flat buffer, or ~k tensors of log-uniform sizes summing to n."""
    if layout == "flat":
        return [n]
    w = np.exp(np.random.default_rng(seed).uniform(0.0, np.log(2000.0), size=k))
    sizes = np.maximum(np.floor(w / w.sum() * n).astype(np.int64), 1)
    sizes[-1] += n - sizes.sum()
    return [int(s) for s in sizes]


STREAM20_SRC = r"""
#include <cstdint>
extern "C" void stream20(float* __restrict__ p, const float* __restrict__ g,
                         float* __restrict__ m, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i], mi = m[i] + gi;
    m[i] = mi; p[i] += mi;
  }
}
"""
STREAM40_SRC = r"""
#include <cstdint>
extern "C" double stream40_first(const float* __restrict__ p, const float* __restrict__ g,
                                 float* __restrict__ m, float* __restrict__ v, int64_t n) {
  double acc = 0.0;
#pragma omp parallel for simd schedule(static) reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    m[i] += gi; v[i] += gi; acc += p[i];
  }
  return acc;
}
extern "C" void stream40_second(float* __restrict__ p, const float* __restrict__ m,
                                const float* __restrict__ v, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] += m[i] + v[i];
}
"""
# per param; Adam's rows: 28
BYTES = {"lion floor": 20, "ours lion": 20, "optax lion": 20,
         "lamb floor": 40, "ours lamb": 40, "optax lamb": 40}
FLOOR = {"lion floor": "lion floor", "ours lion": "lion floor", "optax lion": "lion floor",
         "lamb floor": "lamb floor", "ours lamb": "lamb floor", "optax lamb": "lamb floor"}


def _numpy_state(sizes: list[int], grad_dtype=np.float32):
    rng = np.random.default_rng(0)
    p = [rng.standard_normal(s, dtype=np.float32) for s in sizes]
    g = [(rng.standard_normal(s, dtype=np.float32) * 1e-2).astype(grad_dtype) for s in sizes]
    m = [np.zeros(s, np.float32) for s in sizes]
    v = [np.zeros(s, np.float32) for s in sizes]
    return p, g, m, v


def setup_floor(sizes):
    fn = load_cpu_source(STREAM_SRC, "bench-stream").stream28
    fn.argtypes = [ctypes_ptr] * 4 + [ctypes_i64]
    p, g, m, v = _numpy_state(sizes)

    def step(_: int) -> None:
        for a, b, c, d in zip(p, g, m, v, strict=True):
            fn(a.ctypes.data, b.ctypes.data, c.ctypes.data, d.ctypes.data, a.size)
    return step


def setup_lion_floor(sizes):
    fn = load_cpu_source(STREAM20_SRC, "bench-stream20").stream20
    fn.argtypes = [ctypes_ptr] * 3 + [ctypes_i64]
    p, g, m, _ = _numpy_state(sizes)

    def step(_: int) -> None:
        for a, b, c in zip(p, g, m, strict=True):
            fn(a.ctypes.data, b.ctypes.data, c.ctypes.data, a.size)
    return step


def setup_ours_lion(sizes):
    p, g, m, _ = _numpy_state(sizes)

    def step(_: int) -> None:
        ops.fused_lion(p, g, m, lr=LR, weight_decay=WD)
    return step


def setup_lamb_floor(sizes):
    lib = load_cpu_source(STREAM40_SRC, "bench-stream40")
    first, second = lib.stream40_first, lib.stream40_second
    first.argtypes = [ctypes_ptr] * 4 + [ctypes_i64]
    first.restype = ctypes.c_double
    second.argtypes = [ctypes_ptr] * 3 + [ctypes_i64]
    p, g, m, v = _numpy_state(sizes)

    def step(_: int) -> None:
        for a, b, c, d in zip(p, g, m, v, strict=True):
            first(a.ctypes.data, b.ctypes.data, c.ctypes.data, d.ctypes.data, a.size)
        for a, c, d in zip(p, m, v, strict=True):
            second(a.ctypes.data, c.ctypes.data, d.ctypes.data, a.size)
    return step


def setup_ours_lamb(sizes):
    p, g, m, v = _numpy_state(sizes)

    def step(t: int) -> None:
        ops.fused_lamb(p, g, m, v, step=t, lr=LR, weight_decay=WD)
    return step


def setup_ours(sizes):
    p, g, m, v = _numpy_state(sizes)

    def step(t: int) -> None:
        ops.fused_adam_multi(p, g, m, v, step=t, lr=LR, weight_decay=WD)
    return step


def setup_ours_phase(sizes):
    p, g, m, v = _numpy_state(sizes)
    copies = [np.empty(s, ops.BF16) for s in sizes]

    def step(t: int) -> None:
        total = ops.sum_of_squares(g)
        ops.fused_adam_multi(p, g, m, v, step=t, lr=LR, weight_decay=WD,
                             grad_scale=1.0 / LOSS_SCALE, grad_sumsq=total, max_norm=MAX_NORM,
                             param_copies=copies)
    return step


def _torch_params(sizes):
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-2
    return params


def setup_torch(kind: str):
    def setup(sizes):
        import torch

        params = _torch_params(sizes)
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, **{kind: True})
        return lambda _: opt.step()
    return setup


def setup_torch_phase(sizes):
    import torch

    params = _torch_params(sizes)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    copies = [torch.empty(q.shape, dtype=torch.bfloat16) for q in params]
    grads = [q.grad for q in params]
    inv_scale = torch.full((1,), 1.0 / LOSS_SCALE)

    def step(_: int) -> None:
        found_inf = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        if not found_inf.item():
            opt.step()
        torch._foreach_copy_(copies, [q.detach() for q in params])
    return step


def setup_optax(sizes, make=None):
    import jax
    import optax

    rng = np.random.default_rng(0)
    params = [jax.device_put(rng.standard_normal(s, dtype=np.float32)) for s in sizes]
    grads = [jax.device_put(rng.standard_normal(s, dtype=np.float32) * 1e-2) for s in sizes]
    tx = (make or optax.adamw)(LR, weight_decay=WD)
    box = {"p": params, "s": tx.init(params)}

    def update(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    jitted = jax.jit(update, donate_argnums=(0, 2))

    def step(_: int) -> None:
        box["p"], box["s"] = jitted(box["p"], grads, box["s"])
        jax.block_until_ready(box["p"])
    return step


def setup_deepspeed(sizes):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = _torch_params(sizes)
    opt = DeepSpeedCPUAdam(params, lr=LR, weight_decay=WD, adamw_mode=True)
    return lambda _: opt.step()


import ctypes  # noqa: E402

ctypes_ptr, ctypes_i64 = ctypes.c_void_p, ctypes.c_int64

IMPLS: dict[str, Callable] = {
    "floor": setup_floor,
    "ours": setup_ours,
    "torch fused": setup_torch("fused"),
    "torch foreach": setup_torch("foreach"),
    "optax": setup_optax,
    "deepspeed": setup_deepspeed,
    "ours phase": setup_ours_phase,
    "torch phase": setup_torch_phase,
    "lion floor": setup_lion_floor,
    "ours lion": setup_ours_lion,
    "optax lion": lambda sizes: setup_optax(sizes, __import__("optax").lion),
    "lamb floor": setup_lamb_floor,
    "ours lamb": setup_ours_lamb,
    "optax lamb": lambda sizes: setup_optax(sizes, __import__("optax").lamb),
}


def time_steps(step: Callable[[int], None], steps: int, warmup: int) -> list[float]:
    times = []
    for t in range(1, warmup + steps + 1):
        t0 = time.perf_counter()
        step(t)
        if t > warmup:
            times.append(time.perf_counter() - t0)
    return times


def run(n: int, layout: str, impls: list[str], steps: int, warmup: int) -> dict[str, float]:
    sizes = tensor_sizes(n, layout)
    medians: dict[str, float] = {}
    for name in impls:
        try:
            step = IMPLS[name](sizes)
        except ImportError as e:
            print(f"  {name}: skipped ({e.name} is not installed)", flush=True)
            continue
        medians[name] = statistics.median(time_steps(step, steps, warmup))
        del step
        gc.collect()
        print(f"  {layout:>5} {n / 1e6:5.0f}M {name:<14} {medians[name] * 1e3:8.1f} ms", flush=True)
    return medians


def paired(rounds: list[dict[str, float]], name: str, ref: str | None) -> float | None:
    """The median over rounds of ``name``'s time over ``ref``'s in the same round:
    a shared machine's drift between rounds cancels in each ratio."""
    if ref is None or any(ref not in r for r in rounds):
        return None
    return statistics.median(r[name] / r[ref] for r in rounds)


def table(results: dict[tuple[int, str], dict[str, float]],
          every: dict[tuple[int, str], list[dict[str, float]]]) -> str:
    lines = ["| params | layout | implementation | median ms | x torch fused | x floor | GB/s |",
             "|---|---|---|---|---|---|---|"]
    for (n, layout), med in results.items():
        rounds = every[(n, layout)]
        for name, t in med.items():
            ref = paired(rounds, name, None if name in FLOOR else "torch fused")
            floor = paired(rounds, name, FLOOR.get(name, "floor"))
            vs_torch = f"{ref:.2f}" if ref else "-"
            vs_floor = f"{floor:.2f}" if floor else "-"
            lines.append(f"| {n / 1e6:.0f}M | {layout} | {name} | {t * 1e3:.1f} | {vs_torch} | "
                         f"{vs_floor} | {BYTES.get(name, 28) * n / t / 1e9:.1f} |")
        if "ours phase" in med and "torch phase" in med:
            lines.append(f"| {n / 1e6:.0f}M | {layout} | **phase speed-up (torch/ours)** | | | | "
                         f"**{med['torch phase'] / med['ours phase']:.2f}x** |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[10e6, 50e6, 200e6])
    ap.add_argument("--layouts", nargs="+", default=["flat", "list"], choices=["flat", "list"])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every implementation this many times in turn; report the "
                         "median of the rounds' medians")
    ap.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    print(f"threads={THREADS} torch={torch.__version__} numpy={np.__version__}", flush=True)
    results, every = {}, {}
    for n in (int(s) for s in args.sizes):
        for layout in args.layouts:
            rounds = [run(n, layout, args.impls, args.steps, args.warmup)
                      for _ in range(args.rounds)]  # interleaved: drift hits every row
            results[(n, layout)] = {k: statistics.median(r[k] for r in rounds)
                                    for k in rounds[0]}
            every[(n, layout)] = rounds
    print()
    print(table(results, every))
    if args.json:
        args.json.write_text(json.dumps({f"{n}/{lay}": r for (n, lay), r in results.items()}))


if __name__ == "__main__":
    main()
