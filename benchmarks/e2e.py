"""End-to-end GPT training step: this library's ZeRO stages against DDP, FSDP2 and DeepSpeed.

The model is the peers' harness GPT (pre-LN blocks, causal SDPA attention, 4x
GELU MLP, learned positions, untied head), micro-batch 8 x 128 tokens per
rank, AdamW (lr 1e-4, weight decay 0.01), random tokens. Every mode runs in a
fresh process group of 2 gloo processes with 1 compute thread each (the
threads row: 2 thread ranks in one process), subprocesses of this script,
and the modes are interleaved pass by pass so the machine's noise hits all of
them alike. Step time is rank 0's wall clock per step (forward, backward,
optimizer, and reading the loss); the table gives medians over all passes.

    python benchmarks/e2e.py                         # both sizes, every mode
    python benchmarks/e2e.py --sizes 23m --modes ddp,fsdp2,zero3 --passes 1
    python benchmarks/e2e.py --sizes 23m --modes zero3 --profile
    python benchmarks/e2e.py --sizes 23m --modes zero3,zero3-inv1,zero3-inv4

``-invK`` rows run with ``invariant_shards=K * W`` (the same bits at any world
size dividing it; see [Note: the same bits at any world size]).

``--profile`` adds, for this library's rows, where the step's time goes
(``shard.profile``, see [Note: step profile] in ``shard/monitor/_profile.py``).
DeepSpeed rows run where ``import deepspeed`` works (``make bench`` installs
it); its CPU Adam is compiled on first use, outside the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/gpu.py: the model
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # tests.multiproc: the ranks' port
SIZES = {"23m": dict(layers=6, d=512, heads=8), "91m": dict(layers=12, d=768, heads=12),
         "tiny": dict(layers=2, d=32, heads=2)}  # tiny: the benchmark's own check
VOCAB, SEQ, BATCH, LR, WD = 4096, 128, 8, 1e-4, 0.01
PEERS = ("ddp", "fsdp2", "deepspeed")
OURS = ("zero0", "zero1", "zero2", "zero3", "zero3-recompute", "zero3-threads",
        "zero1-inv1", "zero1-inv4", "zero3-inv1", "zero3-inv4")  # invariant_shards=k x W
MODES = PEERS + OURS


def gpt(layers: int, d: int, heads: int):
    """The GPT of benchmarks/gpu.py (the peers' harness architecture), at CPU sizes."""
    from gpu import Shape, build_model

    return build_model(Shape(vocab=VOCAB, seq=SEQ, d=d, layers=layers, heads=heads,
                             batch=BATCH))


def lm_loss(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- one mode, one process (or thread) per rank --------------------------------------
def timed_steps(step, rank: int, args: argparse.Namespace, comm=None) -> dict:
    """Run warm-up and timed steps; rank 0's times, losses, and (ours, with
    --profile) the step's breakdown."""
    import contextlib

    import torch

    import shard

    g = torch.Generator().manual_seed(1234 + rank)
    times, losses, prof = [], [], None
    for i in range(args.warmup + args.steps):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        measured = i >= args.warmup
        ctx = (shard.profile() if args.profile and comm is not None and measured
               else contextlib.nullcontext())
        t0 = time.perf_counter()
        with ctx as p:
            losses.append(step(idx[:, :-1], idx[:, 1:]))
        dt = time.perf_counter() - t0
        if measured:
            times.append(dt)
            if p is not None:
                prof = p if prof is None else _merge(prof, p)
    out = {"times": times, "loss_first": losses[0], "loss_last": losses[-1]}
    if prof is not None:
        out["profile_ms"] = {k: v / len(times) * 1e3 for k, v in prof.seconds.items()}
    return out


def _merge(a, b):
    for k, v in b.seconds.items():
        a.seconds[k] += v
    a.steps += b.steps
    return a


def torch_step(model, opt):
    def step(x, y):
        loss = lm_loss(model, (x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def ours_step(mode: str, model, comm):
    import interop.torch as it
    import ops
    import shard

    stage = int(mode[4])
    params, fn = it.functional(model, loss=lm_loss,
                               activation_checkpointing=mode.endswith("recompute"))
    zero = (shard.zero0, shard.zero1, shard.zero2, shard.zero3)[stage]
    k = int(mode.split("-inv")[1]) if "-inv" in mode else 0
    train = zero(fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                 options=shard.ZeroOptions(invariant_shards=k * comm.world_size or None))
    holder = [train.init(params)]

    def step(x, y):
        holder[0], metrics = train(holder[0], (x, y))
        return float(metrics["loss"])
    return step


def peer_step(mode: str, model, args: argparse.Namespace):
    import torch

    adam = {"lr": LR, "weight_decay": WD, "fused": args.peer_adam == "fused"}
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        return torch_step(model, torch.optim.AdamW(model.parameters(), **adam))
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return torch_step(model, torch.optim.AdamW(model.parameters(), **adam))
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)

    def step(x, y):
        loss = lm_loss(engine, (x, y))
        engine.backward(loss)
        engine.step()
        return float(loss.detach())
    return step


def rank_main(rank: int, args: argparse.Namespace) -> None:
    """A rank of a 2-process mode, in torchrun's environment (``tests.multiproc.launch``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    comm = None
    if args.worker == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif args.worker in OURS:
        import ops

        comm = ops.init_from_env("gloo")
    else:
        dist.init_process_group("gloo")
    model = gpt(**SIZES[args.size])
    step = (ours_step(args.worker, model, comm) if comm is not None
            else peer_step(args.worker, model, args))
    result = timed_steps(step, rank, args, comm)
    every = [None, None]
    dist.all_gather_object(every, peak_rss_mib())
    if rank == 0:
        result["rss_mib"] = max(every)
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # every rank is done and the result written; skip the process group's
    #              teardown, which can abort (SIGABRT) on a peer that has already gone


def threads_main(args: argparse.Namespace) -> None:
    import copy

    import torch

    import ops

    torch.set_num_threads(1)
    model = gpt(**SIZES[args.size])

    def run(comm):
        return timed_steps(ours_step("zero3", copy.deepcopy(model), comm), comm.rank, args, comm)

    result = ops.spawn(run, 2)[0]
    result["rss_mib"] = peak_rss_mib() / 2  # one process: its peak shared by the two ranks
    Path(args.out).write_text(json.dumps(result))


def worker(args: argparse.Namespace) -> None:
    if args.worker == "zero3-threads":
        threads_main(args)
    else:
        rank_main(int(os.environ["RANK"]), args)


# -- the driver ------------------------------------------------------------------------
def run_one(mode: str, size: str, args: argparse.Namespace) -> dict | None:
    """One mode's run: its 2 ranks started here as processes (the threads row: one
    process), rank 0 writing the result."""
    from tests.multiproc import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", mode, "--size", size, "--out", str(out),
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--peer-adam", args.peer_adam] + (["--profile"] if args.profile else [])
        env = dict(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/zeroshard/torch_ext")))
        try:
            codes, logs = launch(cmd, 1 if mode == "zero3-threads" else 2, env,
                                 timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"  {size} {mode}: timed out after {args.timeout} s", file=sys.stderr)
            return None
        if any(codes) or not out.exists():
            tail = [line for log in logs for line in log.strip().splitlines()[-1:]] or ["?"]
            print(f"  {size} {mode}: failed ({tail[0][:160]})", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def report(results: dict, args: argparse.Namespace) -> str:
    lines = []
    for size in args.sizes:
        rows = {m: r for (s, m), r in results.items() if s == size and r}
        med = {m: statistics.median(t for p in r for t in p["times"]) * 1e3
               for m, r in rows.items()}
        n = sum(p.numel() for p in gpt(**SIZES[size]).parameters()) / 1e6
        lines += ["", f"GPT {size}: {n:.1f}M params, 2 ranks x 8 x {SEQ} tokens; peers' AdamW "
                  f"{args.peer_adam}; medians of {args.passes} pass(es) x {args.steps} steps",
                  "| mode | ms/step | passes | tokens/s | RSS/rank MiB | vs DDP | vs FSDP2 "
                  "| loss first -> last* |", "|---|---|---|---|---|---|---|---|"]
        for m in MODES:
            if m not in rows:
                continue
            r = rows[m]
            passes = " / ".join(f"{statistics.median(p['times']) * 1e3:.0f}" for p in r)
            ratio = {p: (f"{med[m] / med[p]:.2f}" if p in med else "-") for p in ("ddp", "fsdp2")}
            rss = max(p["rss_mib"] for p in r)
            lines.append(f"| {m} | {med[m]:.0f} | {passes} | {2 * BATCH * SEQ / med[m] * 1e3:.0f} "
                         f"| {rss:.0f}{' (process/2)' if m.endswith('threads') else ''} "
                         f"| {ratio['ddp']} | {ratio['fsdp2']} "
                         f"| {r[0]['loss_first']:.4f} -> {r[0]['loss_last']:.4f} |")
        lines.append("* the peers print rank 0's own loss, this library the mean over the "
                     "ranks (metrics['loss'])")
        if args.profile:
            for m in OURS:
                profs = [p["profile_ms"] for p in rows.get(m, []) if "profile_ms" in p]
                if not profs:
                    continue
                keys = [k for k in profs[0] if any(p[k] > 0 for p in profs)]
                ms = {k: statistics.median(p[k] for p in profs) for k in keys}
                total = sum(ms.values())
                lines += ["", f"where {m}'s step goes ({size}, rank 0, shard.profile):",
                          "| category | ms/step | share |", "|---|---|---|"]
                lines += [f"| {k} | {v:.0f} | {100 * v / total:.1f} % |" for k, v in ms.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="23m,91m", help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--peer-adam", choices=["fused", "default"], default="fused",
                    help="torch AdamW for DDP and FSDP2: fused (the fastest on CPU) or default")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--json", help="also write every run's raw result here")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=list(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    args.sizes = [s for s in args.sizes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES)) + sorted(set(args.sizes) - set(SIZES))
    if unknown:
        ap.error(f"unknown modes or sizes: {unknown}")
    if "deepspeed" in modes and not deepspeed_available():
        print("deepspeed is not installed here (make bench installs it): its row is left out",
              file=sys.stderr)
        modes.remove("deepspeed")
    results: dict = {}
    for i in range(args.passes):
        for size in args.sizes:
            for mode in modes:
                t0 = time.perf_counter()
                r = run_one(mode, size, args)
                if r is not None:
                    results.setdefault((size, mode), []).append(r)
                    print(f"pass {i + 1} {size} {mode}: {statistics.median(r['times']) * 1e3:.0f} "
                          f"ms/step ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s} {m}": r for (s, m), r in results.items()}))
    print(report(results, args))


if __name__ == "__main__":
    main()
