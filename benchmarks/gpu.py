"""GPU benchmark: a GPT-2-small-shaped model on one GPU, and the AdamW step.

Training rows (each in its own process, so peak memory is its own):
  torch          plain torch: autocast bf16, torch.optim.AdamW(fused=True).
  fsdp2          torch.distributed.fsdp.fully_shard per block + root at world 1
                 (NCCL), MixedPrecisionPolicy(bf16 params, fp32 reduce), fused AdamW.
  zero3          shard.zero3 on the module through interop.torch, world 1 (NCCL):
                 bf16 compute params and gradients, fp32 masters and reduction.
  zero3 x2       the same with 2 thread ranks on the one GPU (each half the batch).
  fsdp2off       fsdp2 with CPUOffloadPolicy: params, grads and AdamW on the host.
  zero3x1off     zero3 x1 with shard.Offload("host"): masters and moments in host
                 memory, the fused kernel's CPU build updates them there.
  zero3x1ovl     the same with Offload("host", overlap=True): each unit's update
                 starts as soon as its gradient shard is reduced, during the backward.
Each reports the median step time, tokens/s and the peak GPU memory (CuPy
allocates through torch's caching allocator here, so one counter sees both).

AdamW rows (CUDA events, medians; fp32 params, grads and moments):
  floor          28 bytes/param at the device-to-device copy rate measured here.
  ours           ops.fused_adam_multi on CuPy arrays (one launch for all tensors).
  torch fused    torch.optim.AdamW(fused=True).step().
over one flat tensor and ~100 tensors of log-uniform sizes.

Usage:
  python benchmarks/gpu.py                 # everything, on a GPU
  python benchmarks/gpu.py --smoke         # a tiny model on the CPU (no GPU): the
                                           # script's own check, not a measurement
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LR, WD = 3e-4, 0.1


@dataclass
class Shape:
    vocab: int = 50304
    seq: int = 1024
    d: int = 768
    layers: int = 12
    heads: int = 12
    batch: int = 8


SMOKE = Shape(vocab=96, seq=32, d=32, layers=2, heads=2, batch=4)


def build_model(s: Shape):
    """GPT-2 small's shape with an untied head (163M params at the default shape)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(s.d), nn.LayerNorm(s.d)
            self.qkv, self.proj = nn.Linear(s.d, 3 * s.d), nn.Linear(s.d, s.d)
            self.fc, self.out = nn.Linear(s.d, 4 * s.d), nn.Linear(4 * s.d, s.d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, s.heads, d // s.heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(d, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb, self.pos_emb = nn.Embedding(s.vocab, s.d), nn.Embedding(s.seq, s.d)
            self.blocks = nn.ModuleList(Block() for _ in range(s.layers))
            self.ln_f = nn.LayerNorm(s.d)
            self.head = nn.Linear(s.d, s.vocab, bias=False)

        def forward(self, idx):
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return GPT()


def lm_loss(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def batches(s: Shape, n: int, device: str, rows: int | None = None):
    import torch

    g = torch.Generator(device="cpu").manual_seed(1)
    rows = rows or s.batch
    out = []
    for _ in range(n):
        t = torch.randint(0, s.vocab, (rows, s.seq + 1), generator=g)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


def share_torch_allocator() -> None:
    """CuPy allocations through torch's caching allocator: one pool, one counter."""
    import cupy
    import torch

    class _Block:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def __del__(self) -> None:
            torch.cuda.caching_allocator_delete(self.ptr)

    def alloc(size: int):
        ptr = torch.cuda.caching_allocator_alloc(max(size, 1))
        block = _Block(ptr)
        mem = cupy.cuda.UnownedMemory(ptr, size, block, torch.cuda.current_device())
        return cupy.cuda.MemoryPointer(mem, 0)

    cupy.cuda.set_allocator(alloc)


class Clock:
    """Step times: wall clock around a device synchronisation (CPU: no sync)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times = cuda, []

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def run(self, step, n: int, warmup: int) -> None:
        for i in range(warmup + n):
            self.sync()
            t0 = time.perf_counter()
            step(i)
            self.sync()
            if i >= warmup:
                self.times.append(time.perf_counter() - t0)


def _torch_loop(model, s: Shape, steps: int, warmup: int, cuda: bool, autocast: bool) -> dict:
    """Steps of a torch model with fused AdamW; ``autocast``: bf16 autocast."""
    import contextlib

    import torch

    dev = "cuda" if cuda else "cpu"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=cuda)
    data = batches(s, warmup + steps, dev)
    losses = []

    def step(i):
        ctx = torch.autocast(dev, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = lm_loss(model, data[i])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    clock = Clock(cuda)
    clock.run(step, steps, warmup)
    return {"times": clock.times, "loss": float(losses[-1])}


def run_torch(s: Shape, steps: int, warmup: int, cuda: bool) -> dict:
    return _torch_loop(build_model(s).to("cuda" if cuda else "cpu"), s, steps, warmup, cuda,
                       autocast=True)


def run_fsdp2(s: Shape, steps: int, warmup: int, cuda: bool, offload: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29518"))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    model = build_model(s).to("cuda" if cuda else "cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=cuda)} if offload else {}
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, **kw)
    fully_shard(model, mp_policy=mp, **kw)
    out = _torch_loop(model, s, steps, warmup, cuda, autocast=False)
    dist.destroy_process_group()
    return out


def run_zero3(s: Shape, steps: int, warmup: int, cuda: bool, world: int,
              offload: Any = None) -> dict:
    import copy

    import interop.torch as it
    import ops
    import shard

    dev = "cuda" if cuda else "cpu"
    model = build_model(s).to(dev)
    rows = s.batch // world
    data = batches(s, warmup + steps, dev, rows=s.batch)
    policy = shard.Precision(param_dtype=ops.BF16, reduce_dtype=np.float32)

    def train(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=lm_loss)
        step_fn = shard.zero3(fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                              precision=policy, offload=offload)
        state = step_fn.init(params)
        holder = {"state": state, "metrics": None}
        r = comm.rank
        splits = []

        def step(i):
            x, y = data[i]
            holder["state"], holder["metrics"] = step_fn(
                holder["state"], (x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]))
            if i >= warmup:
                splits.append(holder["metrics"]["time_ms"])

        clock = Clock(cuda)
        if comm.rank == 0:
            clock.run(step, steps, warmup)
        else:
            for i in range(warmup + steps):
                step(i)
        split = {k: statistics.median(t[k] for t in splits) for k in splits[0]}
        return {"times": clock.times, "loss": float(holder["metrics"]["loss"]),
                "split_ms": split}

    if world == 1 and cuda:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29517"))
        return train(ops.init_from_env(backend="nccl"))
    return ops.spawn(train, world, timeout=600)[0]


def adam_table(sizes: list[float], steps: int) -> list[dict]:
    import cupy
    import torch


    def median_ms(fn, n=steps, warmup=3):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(n):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(cupy.cuda.get_elapsed_time(a, b))
        torch.cuda.synchronize()
        return statistics.median(times)

    rate = _copy_rate(median_ms)
    rows = []
    rng = np.random.default_rng(0)
    for n in sizes:
        n = int(n)
        w = np.exp(rng.uniform(0.0, np.log(2000.0), size=100))
        split = np.maximum(np.floor(w / w.sum() * n).astype(np.int64), 1)
        split[-1] += n - split.sum()
        for layout, parts in (("flat", [n]), ("100 tensors", [int(x) for x in split])):
            ours_ms = median_ms(_ours_adam(parts))
            torch_ms = median_ms(_torch_adam(parts))
            rows.append({"params": n, "layout": layout, "floor_ms": 28 * n / rate * 1e3,
                         "ours_ms": ours_ms, "torch_fused_ms": torch_ms,
                         "copy_GBps": rate / 1e9})
    return rows


def _copy_rate(median_ms) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written."""
    import cupy

    src = cupy.empty(1 << 28, np.float32)  # 1 GiB
    dst = cupy.empty_like(src)
    return 2 * src.nbytes / (median_ms(lambda: dst.__setitem__(Ellipsis, src)) / 1e3)


def _ours_adam(parts: list[int]):
    import cupy

    import ops

    p = [cupy.random.standard_normal(k, dtype=np.float32) for k in parts]
    g = [cupy.random.standard_normal(k, dtype=np.float32) * 1e-2 for k in parts]
    m = [cupy.zeros(k, np.float32) for k in parts]
    v = [cupy.zeros(k, np.float32) for k in parts]
    count = [0]

    def step():
        count[0] += 1
        ops.fused_adam_multi(p, g, m, v, step=count[0], lr=LR, weight_decay=WD)
    return step


def _torch_adam(parts: list[int]):
    import torch

    params = [torch.nn.Parameter(torch.randn(k, device="cuda")) for k in parts]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-2
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True).step


def child(args) -> None:
    s = SMOKE if args.smoke else Shape()
    cuda = not args.smoke
    import torch

    if cuda:
        share_torch_allocator()
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.child == "torch":
        out = run_torch(s, args.steps, args.warmup, cuda)
    elif args.child in ("fsdp2", "fsdp2off"):
        out = run_fsdp2(s, args.steps, args.warmup, cuda, offload=args.child == "fsdp2off")
    elif args.child == "adam":
        out = {"adam": adam_table(args.adam_sizes, args.steps)}
    else:
        import shard

        world = int(args.child[len("zero3x")])
        kind = args.child[len("zero3x1"):]
        offload = shard.Offload("host", overlap=kind == "ovl") if kind else None
        out = run_zero3(s, args.steps, args.warmup, cuda, world=world, offload=offload)
    if cuda:
        out["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    print("RESULT " + json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None,
                    help="rows to run: torch fsdp2 zero3x1 zero3x2 fsdp2off zero3x1off "
                         "zero3x1ovl adam")
    ap.add_argument("--adam-sizes", type=float, nargs="*", default=[50e6, 200e6])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--row-timeout", type=float, default=300)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    rows = args.only or (["torch", "zero3x2"] if args.smoke
                         else ["torch", "fsdp2", "zero3x1", "zero3x2", "fsdp2off",
                               "zero3x1off", "zero3x1ovl", "adam"])
    s = SMOKE if args.smoke else Shape()
    results = {}
    from tests.multiproc import launch  # a fresh process a row (forked in the tests' runs)

    for row in rows:
        cmd = [sys.executable, __file__, "--child", row, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--adam-sizes", *map(str, args.adam_sizes)]
        cmd += ["--smoke"] if args.smoke else []
        try:
            (code,), (log,) = launch(cmd, 1, {}, timeout=args.row_timeout)
        except subprocess.TimeoutExpired:
            results[row] = {"error": f"timed out after {args.row_timeout} s"}
            print(f"{row}: {results[row]['error']}", file=sys.stderr, flush=True)
            continue
        line = [x for x in log.splitlines() if x.startswith("RESULT ")]
        if code or not line:
            results[row] = {"error": log[-2000:]}
            print(f"{row}: failed\n{results[row]['error']}", file=sys.stderr, flush=True)
            continue
        results[row] = json.loads(line[-1][len("RESULT "):])
        print(f"{row}: {json.dumps(results[row])}", flush=True)
    tokens = s.batch * s.seq
    print(f"\nGPT {s.layers} x {s.d}, {s.heads} heads, vocab {s.vocab}, "
          f"{s.batch} x {s.seq} tokens per step, {args.steps} steps after {args.warmup}")
    print(f"{'row':10} {'median ms':>10} {'tokens/s':>10} {'vs torch':>9} {'peak GiB':>9} "
          f"{'loss':>8} {'bwd ms':>7} {'opt ms':>7}")
    base = results.get("torch", {}).get("times")
    for row in rows:
        r = results[row]
        if row == "adam" or "error" in r:
            if "error" in r:
                print(f"{row:10} failed")
            continue
        ms = statistics.median(r["times"]) * 1e3
        ratio = ms / (statistics.median(base) * 1e3) if base else math.nan
        split = r.get("split_ms", {})
        print(f"{row:10} {ms:10.1f} {tokens / ms * 1e3:10.0f} {ratio:9.2f} "
              f"{r.get('peak_GiB', math.nan):9.2f} {r['loss']:8.3f} "
              f"{split.get('backward', math.nan):7.1f} {split.get('optimizer', math.nan):7.1f}")
    off, ovl = results.get("zero3x1off", {}), results.get("zero3x1ovl", {})
    if "times" in off and "times" in ovl:  # how much of the host update the overlap hid
        saved = (statistics.median(off["times"]) - statistics.median(ovl["times"])) * 1e3
        print(f"\noverlap: the offloaded update takes {off['split_ms']['optimizer']:.1f} ms "
              f"after the backward; overlapped, {ovl['split_ms']['optimizer']:.1f} ms is still "
              f"exposed and the step is {saved:.1f} ms shorter: "
              f"{saved / off['split_ms']['optimizer']:.0%} of the update hidden")
    for row in rows:  # a zero3 row's whole split: where its step's time went
        if "split_ms" in results[row]:
            print(f"  {row} split (median ms): " + ", ".join(
                f"{k} {v:.1f}" for k, v in results[row]["split_ms"].items()))
    if "adam" in results and "error" not in results["adam"]:
        print(f"\nAdamW step (fp32), median ms; floor = 28 B/param at "
              f"{results['adam']['adam'][0]['copy_GBps']:.0f} GB/s")
        print(f"{'params':>8} {'layout':12} {'floor':>7} {'ours':>7} {'torch':>7} "
              f"{'ours/torch':>10} {'ours/floor':>10}")
        for a in results["adam"]["adam"]:
            print(f"{a['params'] / 1e6:7.0f}M {a['layout']:12} {a['floor_ms']:7.2f} "
                  f"{a['ours_ms']:7.2f} {a['torch_fused_ms']:7.2f} "
                  f"{a['ours_ms'] / a['torch_fused_ms']:10.2f} "
                  f"{a['ours_ms'] / a['floor_ms']:10.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
