"""Pipeline parallelism: ours (``shard.pipeline`` + ZeRO-1) against
``torch.distributed.pipelining`` (Schedule1F1B) and DeepSpeed's ``PipelineModule``
(its 1F1B ``TrainSchedule``, on the CPU accelerator), side by side.

    python benchmarks/pipeline.py [--stages 2,4] [--micro 4,8] [--steps 6] [--model mlp|gpt]

The model is L square layers (tanh) and a mean-squared-error loss, split into P
stages of L/P layers, one gloo process per stage, one compute thread
each; one launch per (P, M) runs every framework in turn. Ours is in JAX (a
``shard.Layered`` loss), torch's and DeepSpeed's in torch (DeepSpeed's row is
left out when it is not installed; ``make bench`` installs it). For each
framework the same model also runs on one process (P = 1) in the same run, so
a pipeline's efficiency is judged against its own framework:
``bubble (est.) = 1 - (T1 / P) / T_P``. Ours also measures its bubble directly:
the share of the step a stage spends blocked on its neighbours
(``metrics["time_ms"]["pipeline_wait"]``, averaged over stages). The theory for
1F1B and GPipe is ``(P - 1) / (M + P - 1)``. With more processes than cores (P = 4 on
this 2-core machine) the stages also wait for a core, so the bubbles there are
upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def ours(args: argparse.Namespace) -> dict:
    import jax.numpy as jnp
    import numpy as np

    import ops
    import shard

    comm = ops.init_from_env()

    def hidden(p, h, b):
        return jnp.tanh((b["x"] if h is None else h) @ p["w"] + p["b"])

    def last(p, h, b):
        return jnp.mean((jnp.tanh(h @ p["w"] + p["b"]) - b["y"]) ** 2)

    rng = np.random.default_rng(0)
    params = [{"w": (rng.standard_normal((args.width, args.width)) / np.sqrt(args.width))
               .astype(np.float32), "b": np.zeros(args.width, np.float32)}
              for _ in range(args.layers)]
    batch = {"x": rng.standard_normal((args.batch, args.width)).astype(np.float32),
             "y": rng.standard_normal((args.batch, args.width)).astype(np.float32)}
    layered = shard.Layered([hidden] * (args.layers - 1) + [last])
    pipe = shard.pipeline(layered, comm=comm, stages=comm.world_size,
                          microbatches=args.microbatches, schedule=args.schedule)
    step = shard.zero1(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
    state = step.init(pipe.params(params))
    times, waits = [], []
    for i in range(args.steps + 2):
        state, m = step(state, batch)
        if i >= 2:  # after compiling and warming up
            times.append(m["time_ms"]["step"])
            waits.append(m["time_ms"]["pipeline_wait"] / m["time_ms"]["step"])
    every = ops.all_gather(comm, np.array([statistics.median(times),
                                           statistics.mean(waits)]))
    return {"step_ms": float(np.max(every[0::2])), "bubble": float(np.mean(every[1::2]))}


def torch_model(args: argparse.Namespace) -> tuple[list, object, object, object]:
    """The torch-side model, the same for every framework: ``(layers, x, y,
    loss(out, y))``. ``--model mlp``: L square layers and tanh; ``--model gpt``:
    ``examples/gpt.py``'s GPT as a chain (embeddings, L blocks, norm and head;
    the head's weight its own, untied, as the peers' pipelines split it)."""
    import torch

    torch.manual_seed(0)
    if args.model == "gpt":
        import torch.nn.functional as F

        from examples import gpt

        cfg = gpt.GPTConfig(seq=args.seq, d=args.width, layers=args.layers, heads=4)
        x, y = gpt.sample_batch(gpt.corpus(), 0, args.batch, cfg.seq)
        return (gpt.chain(gpt.build(cfg)), x, y,
                lambda out, target: F.cross_entropy(out.flatten(0, 1), target.flatten()))
    layers = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh())
              for _ in range(args.layers)]
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    return layers, x, y, lambda out, target: ((out - target) ** 2).mean()


def ours_torch(args: argparse.Namespace) -> dict:
    """Ours over the torch layers the peers train (``interop.torch.layered``)."""
    import numpy as np
    import torch

    import interop.torch as it
    import ops
    import shard

    torch.set_num_threads(1)
    comm = ops.init_from_env()
    layers, x, y, loss_fn = torch_model(args)
    params, loss = it.layered(layers, loss=lambda out, b: loss_fn(out, b[1]))
    pipe = shard.pipeline(loss, comm=comm, stages=comm.world_size,
                          microbatches=args.microbatches, schedule=args.schedule,
                          balance=[len(layers) // comm.world_size] * comm.world_size)
    step = shard.zero1(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
    state = step.init(pipe.params(params))
    times, waits = [], []
    for i in range(args.steps + 2):
        state, m = step(state, (x, y))
        if i >= 2:
            times.append(m["time_ms"]["step"])
            waits.append(m["time_ms"]["pipeline_wait"] / m["time_ms"]["step"])
    every = ops.all_gather(comm, np.array([statistics.median(times),
                                           statistics.mean(waits)]))
    return {"step_ms": float(np.max(every[0::2])), "bubble": float(np.mean(every[1::2]))}


def torch_pipelining(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():  # DeepSpeed, run before it in this launch, did
        dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    layers, x, y, loss_fn = torch_model(args)
    per = len(layers) // w
    mod = torch.nn.Sequential(*layers[r * per:(r + 1) * per])
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    m = args.microbatches
    if w > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(mod, r, w, torch.device("cpu"))
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        sched = kind(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    times = []
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        if w == 1:  # the same micro-batches, one after the other
            for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
                (loss_fn(mod(xs), ys) / m).backward()
        elif r == 0:
            sched.step(x)
        elif r == w - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - t0))
    return _slowest_rank(times)


def _slowest_rank(times: list[float]) -> dict:
    """The torch-side result: the slowest stage's median step (a collective)."""
    import torch
    import torch.distributed as dist

    every = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor([statistics.median(times)]))
    return {"step_ms": max(float(t) for t in every), "bubble": None}


def deepspeed_pipe(args: argparse.Namespace) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    w = dist.get_world_size()
    layers, x, y, loss_fn = torch_model(args)
    net = PipelineModule(layers=layers, num_stages=w, partition_method="uniform",
                         loss_fn=loss_fn)
    m = args.microbatches
    cfg = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch // m,
           "gradient_accumulation_steps": m, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                           config=cfg)

    def micro():
        while True:
            yield from zip(x.chunk(m), y.chunk(m), strict=True)

    data, times = micro(), []
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        engine.train_batch(data_iter=data)
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - t0))
    return _slowest_rank(times)


WORKERS = {"ours": ours, "ours_torch": ours_torch, "torch": torch_pipelining,
           "deepspeed": deepspeed_pipe}


def run(frameworks: tuple[str, ...], p: int, m: int, args: argparse.Namespace) -> dict:
    """``{framework: result}`` of one launch of ``p`` processes that runs each of
    ``frameworks`` in turn, each warmed up before it is timed. The peers run
    first, so whatever an earlier framework leaves behind in the processes can
    only slow ours; DeepSpeed first of all, as its own launches start it (its
    process group is the one the others then find)."""
    from tests.multiproc import launch

    order = sorted(frameworks, key=lambda f: (f.startswith("ours"), f != "deepspeed"))
    cmd = [sys.executable, __file__, "--worker", ",".join(order), "--microbatches", str(m),
           "--layers", str(args.layers),
           "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps),
           "--model", args.model, "--seq", str(args.seq),
           "--schedule", args.schedule]
    codes, logs = launch(cmd, p, dict(
        OMP_NUM_THREADS="1",
        XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"),
        timeout=3600)
    got = dict(json.loads(x[len("RESULT "):]) for x in logs[0].splitlines()
               if x.startswith("RESULT "))
    if any(codes) or set(got) != set(frameworks):
        raise RuntimeError(f"{','.join(frameworks)} P={p} M={m} failed:\n"
                           + "\n".join(log[-3000:] for log in logs))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--micro", default="4,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--model", default="mlp", choices=["mlp", "gpt"],
                    help="gpt: examples/gpt.py's blocks (width = d, layers = blocks; ours "
                         "over torch modules only)")
    ap.add_argument("--seq", type=int, default=32, help="--model gpt: sequence length")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--microbatches", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        for framework in args.worker.split(","):
            result = WORKERS[framework](args)
            if int(os.environ.get("RANK", "0")) == 0:
                print("RESULT " + json.dumps([framework, result]), flush=True)
        sys.stdout.flush()
        os._exit(0)  # every rank is done (the results were all-gathered); skip the
        #              process group's teardown, which can abort on peers already gone
    stages = [int(s) for s in args.stages.split(",")]
    micro = [int(m) for m in args.micro.split(",")]
    what = (f"examples/gpt.py's GPT with {args.layers} blocks of d = {args.width}, seq "
            f"{args.seq}" if args.model == "gpt" else
            f"{args.layers} layers of {args.width}x{args.width}")
    print(f"{what}, batch {args.batch}, "
          f"{args.schedule}, medians of {args.steps} steps; "
          f"{os.cpu_count()} cores", flush=True)
    try:
        import deepspeed  # noqa: F401
        frameworks = ("ours", "ours_torch", "torch", "deepspeed")
    except ImportError:
        frameworks = ("ours", "ours_torch", "torch")
        print("DeepSpeed is not installed: its column is left out", flush=True)
    if args.model == "gpt":  # a torch model: no JAX row
        frameworks = frameworks[1:]
    rows = []
    base = {(f, m): r["step_ms"] for m in micro for f, r in run(frameworks, 1, m, args).items()}
    for p in stages:
        for m in micro:
            for f, r in run(frameworks, p, m, args).items():
                rows.append((p, m, f, r))
                print(f"  P={p} M={m} {f}: {r['step_ms']:.1f} ms", flush=True)
    for m in micro:
        print(f"one process, M={m}: " + ", ".join(f"{f} {base[f, m]:.1f} ms" for f in frameworks))
    print()
    print(table(stages, micro, frameworks, rows, base))


NAMES = {"ours": "ours (JAX)", "ours_torch": "ours (torch)", "torch": "torch",
         "deepspeed": "DeepSpeed"}


def table(stages: list[int], micro: list[int], frameworks: tuple[str, ...], rows: list,
          base: dict) -> str:
    """Per framework: ms/step and the bubble estimated against its own P = 1 run
    (ours also measured); then ours (torch) over each peer."""
    peers = [f for f in frameworks if not f.startswith("ours")]
    head = ["P", "M", "theory"]
    for f in frameworks:
        head += [f"{NAMES[f]} ms", f"{NAMES[f]} bubble (est.)"]
        if f.startswith("ours"):
            head.append(f"{NAMES[f]} bubble (measured)")
    head += [f"ours (torch) / {NAMES[f]}" for f in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in stages:
        for m in micro:
            got = {f: r for pp, mm, f, r in rows if (pp, mm) == (p, m)}
            cells = [str(p), str(m), f"{(p - 1) / (m + p - 1):.2f}"]
            for f in frameworks:
                ms = got[f]["step_ms"]
                cells += [f"{ms:.1f}", f"{1 - base[f, m] / p / ms:.2f}"]
                if f.startswith("ours"):
                    cells.append(f"{got[f]['bubble']:.2f}")
            cells += [f"{got['ours_torch']['step_ms'] / got[f]['step_ms']:.2f}" for f in peers]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
