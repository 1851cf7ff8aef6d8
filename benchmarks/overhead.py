"""What the library costs per unit per step: a GPU's view of the step, measured on the CPU.

A GPT whose compute is negligible (12 blocks of width 64, sequence 16, batch 2,
vocabulary 256: 16 units, 149 parameter tensors) makes each step framework
overhead. Each mode runs in its own process at world 1 (gloo), modes
interleaved pass by pass; the table gives medians:

  torch     plain torch, torch.optim.AdamW(fused=True)
  ddp       DistributedDataParallel, the same optimizer
  fsdp2     fully_shard per block and on the root, the same optimizer
  zero0-3   shard.zero0 ... shard.zero3 on the module (interop.torch.functional),
            ops.adamw
  zero*x2   (with --threads) the same on 2 thread ranks in one process, each
            rank half the batch
  jax       (with --jax) the same GPT in JAX: value_and_grad and optax.adamw
            under one jax.jit, one CPU device
  jax_fsdp  the same over 2 host devices, FSDP-style: params sharded on their
            first dimension (NamedSharding), the batch on its rows, one jit
  layered3  shard.zero3 on the GPT as a shard.Layered (one JAX layer a unit),
            world 1; layered3x2 on 2 thread ranks
  fn3       shard.zero3 on the GPT's plain JAX loss function, world 1 (one
            program); fn3x2 on 2 thread ranks, where the traced program is cut
            into one segment a unit (see [Note: traced units])

Columns besides the time:

  calls/unit   Python function calls into the library (shard, ops, interop; for
               fsdp2, torch.distributed.fsdp) per unit per step, counted by cProfile
               over the timed steps of a separate run.
  device ops   operations a GPU would pay for, per unit per step, by kind:
               allocations, copies, kernel launches, collectives, host reads,
               DLPack exchanges. Ours are counted on ops.testing's stand-in
               device (the same step over stand-in state). FSDP2's are the aten
               operations inside its own FSDP:: profiler scopes (torch.profiler),
               leaf operations only, views left out; its optimizer, like the
               model's compute, is outside those scopes, so its column leaves
               the optimizer out. Ours counts everything the step does outside
               the model's forward and backward, its fused optimizer included.
               Both include autograd's accumulation into .grad (its aten
               operations, by the profiler): none where autograd hands its
               fresh gradient over, an add per parameter where .grad is a view
               of a gradient buffer.

Usage:
  python benchmarks/overhead.py                       # about 3 minutes
  python benchmarks/overhead.py --passes 1 --steps 10 # a quick look
  python benchmarks/overhead.py --layers 24 --width 128 --threads
  python benchmarks/overhead.py --modes torch --jax     # the JAX rows
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LR, WD = 3e-4, 0.1
PEERS = ("torch", "ddp", "fsdp2")
OURS = ("zero0", "zero1", "zero2", "zero3")
JAX = ("jax", "jax_fsdp", "layered3", "layered3x2", "fn3", "fn3x2")
KINDS = ("alloc", "copy", "kernel", "collective", "host_read", "dlpack")


def shape(args: argparse.Namespace) -> Any:
    from benchmarks.gpu import Shape

    return Shape(vocab=args.vocab, seq=args.seq, d=args.width, layers=args.layers,
                 heads=args.heads, batch=args.batch)


def model_and_data(args: argparse.Namespace, n: int) -> tuple[Any, list]:
    from benchmarks.gpu import batches, build_model

    s = shape(args)
    return build_model(s), batches(s, n, "cpu")


def init_gloo() -> None:
    from tests.multiproc import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")


# -- one mode's step functions ----------------------------------------------------------
def peer_step(mode: str, model: Any) -> Any:
    import torch
    import torch.distributed as dist

    from benchmarks.gpu import lm_loss

    if mode != "torch":
        init_gloo()
        dist.init_process_group("gloo")
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)

    def step(batch: Any) -> float:
        loss = lm_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def ours_step(mode: str, model: Any, comm: Any, device: Any = None) -> tuple[Any, int]:
    import interop.torch as it
    import ops
    import shard
    from benchmarks.gpu import lm_loss

    params, fn = it.functional(model, loss=lm_loss)
    if device is not None:
        from ops.testing import to_device

        params = to_device(params, device)
    zero = getattr(shard, mode[:5])
    train = zero(fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
    holder = [train.init(params)]

    def step(batch: Any) -> Any:
        holder[0], metrics = train(holder[0], batch)
        return metrics

    return step, len(holder[0].meta.layout.units)


def halves(batch: Any, rank: int, world: int) -> Any:
    n = batch[0].shape[0] // world
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


# -- measurements -------------------------------------------------------------------------
def timed(step: Any, data: list, warmup: int) -> list[float]:
    times = []
    for i, batch in enumerate(data):
        t0 = time.perf_counter()
        step(batch)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def library_calls(step: Any, data: list, prefixes: tuple[str, ...]) -> float:
    """Calls of functions defined under ``prefixes``, per step."""
    prof = cProfile.Profile()
    prof.enable()
    for batch in data:
        step(batch)
    prof.disable()
    stats = pstats.Stats(prof).stats
    calls = sum(nc for (file, _, _), (_, nc, *_) in stats.items() if file.startswith(prefixes))
    return calls / len(data)


def profiled(step: Any, data: list) -> Any:
    """The steps' torch profile (CPU activities: the aten operations each issues)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in data:
            step(batch)
    return prof


def torch_ops(prof: Any, scopes: tuple[str, ...], within: str | None = None) -> dict[str, int]:
    """Leaf aten operations (views left out) inside profiler events whose names
    start with one of ``scopes``, by kind (see the module docstring); with
    ``within``, only those under the profiler range of that name."""
    counts = dict.fromkeys(KINDS, 0)

    def visit(event: Any, inside: bool) -> None:
        name = event.name
        inside = inside or name.startswith(scopes)
        kind = _kind(name)
        if kind == "collective" and inside:
            counts[kind] += 1
            return
        aten_children = [c for c in event.cpu_children if c.name.startswith("aten::")]
        if inside and name.startswith("aten::") and not aten_children and kind:
            counts[kind] += 1
        for child in event.cpu_children:
            visit(child, inside)

    def roots(event: Any) -> list[Any]:
        if within is None or event.name == within:
            return [event]
        return [r for child in event.cpu_children for r in roots(child)]

    for event in prof.events():
        if event.cpu_parent is None:
            for root in roots(event):
                visit(root, False)
    return counts


# autograd's accumulation into .grad: an operation of the framework's choosing
# (none where autograd hands its fresh gradient over, an add where .grad is a
# view of a bucket), counted for every framework alike
ACCUMULATE = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"


def fsdp2_device_ops(step: Any, data: list) -> dict[str, float]:
    """FSDP2's own device operations per step (see the module docstring)."""
    counts = torch_ops(profiled(step, data), ("FSDP::", ACCUMULATE))
    return {k: v / len(data) for k, v in counts.items()}


VIEWS = {"view", "_unsafe_view", "as_strided", "alias", "split", "split_with_sizes", "slice",
         "t", "transpose", "narrow", "select", "reshape", "detach", "expand", "unsqueeze",
         "squeeze", "flatten", "chunk", "unflatten", "_reshape_alias", "resize_", "set_",
         "lift_fresh", "result_type", "is_same_size", "_has_compatible_shallow_copy_type",
         "record_stream", "sym_size", "sym_stride", "sym_numel", "size", "stride", "numel"}


def _kind(name: str) -> str | None:
    if "c10d" in name or "all_gather" in name or "reduce_scatter" in name or (
            "all_reduce" in name):
        return "collective"
    if not name.startswith("aten::"):
        return None
    op = name[len("aten::"):]
    if op in VIEWS:
        return None
    if op.startswith(("empty", "new_empty")):
        return "alloc"
    if op in ("copy_", "_chunk_cat", "split_with_sizes_copy", "cat", "fill_", "zero_",
              "_foreach_copy_", "clone", "_to_copy"):
        return "copy"
    return "kernel"


def standin_device_ops(mode: str, args: argparse.Namespace, world: int) -> dict[str, float]:
    """Our step's device operations per step, on the stand-in device."""
    import copy

    import ops
    from ops.testing import DEVICE_OPS, STANDIN

    model, data = model_and_data(args, args.count_steps + 2)

    def run(comm: Any) -> dict[str, float]:
        step, _ = ours_step(mode, copy.deepcopy(model), comm, STANDIN)
        part = [halves(b, comm.rank, world) for b in data]
        for b in part[:2]:
            step(b)
        from torch.profiler import record_function

        def ranked(b: Any) -> Any:  # this rank's operations, under a range of its own
            with record_function(f"rank{comm.rank}"):
                return step(b)

        DEVICE_OPS.reset()
        before = DEVICE_OPS.snapshot()
        if comm.rank:  # torch's profiler is one per process: rank 0 runs it
            for b in part[2:]:
                ranked(b)
            return {}
        prof = profiled(ranked, part[2:])
        after = DEVICE_OPS.snapshot()
        accumulate = torch_ops(prof, (ACCUMULATE,), within="rank0")
        return {k: (after[k] - before[k] + accumulate[k]) / args.count_steps for k in KINDS}

    return ops.spawn(run, world)[0]


# -- the JAX GPT ---------------------------------------------------------------------------
def jax_gpt(args: argparse.Namespace) -> tuple[list, list, Any]:
    """The GPT of benchmarks/gpu.py in JAX: per-unit params (embeddings, blocks,
    the final norm with the head), one layer function a unit, and the loss."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    d, v, t, h = args.width, args.vocab, args.seq, args.heads
    rng = np.random.default_rng(0)

    def w(*shape: int) -> Any:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    def z(*shape: int) -> Any:
        return np.zeros(shape, np.float32)

    def norm(x: Any, g: Any, b: Any) -> Any:
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b

    def embed(p: Any, _: Any, batch: Any) -> Any:
        return p["tok"][batch[0]] + p["pos"][None]

    def block(p: Any, x: Any, _: Any) -> Any:
        b_, t_, _d = x.shape
        q, k, v_ = jnp.split(norm(x, p["ln1_g"], p["ln1_b"]) @ p["qkv_w"] + p["qkv_b"], 3, -1)
        q, k, v_ = (a.reshape(b_, t_, h, d // h).transpose(0, 2, 1, 3) for a in (q, k, v_))
        att = jnp.where(jnp.tril(jnp.ones((t_, t_), bool)), q @ k.transpose(0, 1, 3, 2), -jnp.inf)
        y = jax.nn.softmax(att / np.sqrt(d // h), -1) @ v_
        x = x + y.transpose(0, 2, 1, 3).reshape(b_, t_, d) @ p["proj_w"] + p["proj_b"]
        m = jax.nn.gelu(norm(x, p["ln2_g"], p["ln2_b"]) @ p["fc_w"] + p["fc_b"], approximate=False)
        return x + m @ p["out_w"] + p["out_b"]

    def head(p: Any, x: Any, batch: Any) -> Any:
        logits = norm(x, p["ln_g"], p["ln_b"]) @ p["w"]
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, batch[1][..., None], -1).mean()

    params = [{"tok": w(v, d), "pos": w(t, d)}]
    params += [{"ln1_g": z(d) + 1, "ln1_b": z(d), "qkv_w": w(d, 3 * d), "qkv_b": z(3 * d),
                "proj_w": w(d, d), "proj_b": z(d), "ln2_g": z(d) + 1, "ln2_b": z(d),
                "fc_w": w(d, 4 * d), "fc_b": z(4 * d), "out_w": w(4 * d, d), "out_b": z(d)}
               for _ in range(args.layers)]
    params.append({"ln_g": z(d) + 1, "ln_b": z(d), "w": w(d, v)})
    layers = [embed] + [block] * args.layers + [head]

    def loss(params: list, batch: Any) -> Any:
        x = None
        for layer, p in zip(layers, params, strict=True):
            x = layer(p, x, batch)
        return x

    return params, layers, loss


def jax_data(args: argparse.Namespace, n: int) -> list:
    return [tuple(t.numpy().astype("int32") for t in b) for b in model_and_data(args, n)[1]]


def fsdp_placed(params: Any, devices: int = 2) -> tuple[Any, Any]:
    """``params`` sharded FSDP-style over ``devices`` host devices (a "data"
    mesh axis; each leaf on its first dimension where it divides, else
    replicated), and a function placing a batch on its rows."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(jax.devices()[:devices], ("data",))

    def spec(x: Any) -> Any:
        split = x.ndim and x.shape[0] % devices == 0
        return NamedSharding(mesh, PartitionSpec("data") if split else PartitionSpec())

    rows = NamedSharding(mesh, PartitionSpec("data"))
    return (jax.tree_util.tree_map(lambda x: jax.device_put(x, spec(x)), params),
            lambda batch: jax.device_put(batch, rows))


def jax_step(mode: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """A jitted training step of the JAX GPT (one device, or FSDP-style over two)."""
    params, _, loss = jax_gpt(args)
    place = lambda tree: tree  # noqa: E731
    if mode == "jax_fsdp":
        params, place = fsdp_placed(params)
    return optax_step(params, loss, place), place


def optax_step(params: Any, loss: Any, place: Any) -> Any:
    """``step(batch) -> loss``: value_and_grad and optax.adamw under one
    ``jax.jit``, the batch placed by ``place`` first."""
    import jax
    import optax

    opt = optax.adamw(LR, weight_decay=WD)
    state = [params, opt.init(params)]

    @jax.jit
    def update(params: Any, opt_state: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def step(batch: Any) -> Any:
        state[0], state[1], value = update(state[0], state[1], place(batch))
        return jax.block_until_ready(value)

    return step


def layered_step(args: argparse.Namespace, comm: Any,
                 plain: bool = False) -> tuple[Any, int, list]:
    """shard.zero3 on the JAX GPT as a ``shard.Layered``, or (``plain``) on its
    loss function as written."""
    import ops
    import shard

    params, layers, loss = jax_gpt(args)
    train = shard.zero3(loss if plain else shard.Layered(layers),
                        optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
    holder = [train.init(params)]
    splits: list[dict] = []

    def step(batch: Any) -> Any:
        holder[0], metrics = train(holder[0], batch)
        splits.append(metrics["time_ms"])
        return metrics

    return step, len(layers), splits


def jax_worker(args: argparse.Namespace) -> dict[str, Any]:
    import ops

    mode = args.worker
    data = jax_data(args, args.warmup + args.steps)
    if mode in ("jax", "jax_fsdp"):
        step, _ = jax_step(mode, args)
        return {"times": timed(step, data, args.warmup)}
    world = 2 if mode.endswith("x2") else 1

    def run(comm: Any) -> dict[str, Any]:
        step, units, splits = layered_step(args, comm, plain=mode.startswith("fn"))
        part = [halves(b, comm.rank, world) for b in data]
        times = timed(step, part, args.warmup)
        split = {k: statistics.median(s.get(k, 0.0) for s in splits[args.warmup:])
                 for k in ("forward", "backward")}
        return {"times": times, "units": units, "split": split}

    return ops.spawn(run, world)[0]


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    mode, world = args.worker, 2 if args.worker.endswith("x2") else 1
    if mode in JAX:
        Path(args.out).write_text(json.dumps(jax_worker(args)))
        sys.stdout.flush()
        os._exit(0)
    model, data = model_and_data(args, args.warmup + args.steps)
    out: dict[str, Any] = {}
    if mode in PEERS:
        step = peer_step(mode, model)
        out["times"] = timed(step, data, args.warmup)
        if args.counts and mode == "fsdp2":
            out["calls"] = library_calls(step, data[:args.count_steps],
                                         (str(Path(torch.__file__).parent / "distributed"
                                              / "fsdp"),))
            out["ops"] = fsdp2_device_ops(step, data[:args.count_steps])
        out["units"] = args.layers + 1 if mode == "fsdp2" else None
    else:
        import copy

        import ops

        def run(comm: Any) -> dict[str, Any]:
            step, units = ours_step(mode, copy.deepcopy(model), comm)
            part = [halves(b, comm.rank, world) for b in data]
            res: dict[str, Any] = {"times": timed(step, part, args.warmup), "units": units}
            if args.counts:
                res["calls"] = library_calls(step, part[:args.count_steps], tuple(
                    str(ROOT / p) for p in ("shard", "ops", "interop")))
            return res

        if world == 1:
            init_gloo()
            out = run(ops.init_from_env("gloo"))
        else:
            out = ops.spawn(run, world)[0]
        if args.counts:
            out["ops"] = standin_device_ops(mode[:5], args, world)
    Path(args.out).write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # skip the process group's teardown


# -- the driver ---------------------------------------------------------------------------
def run_mode(mode: str, args: argparse.Namespace, counts: bool) -> dict | None:
    import tempfile

    from tests.multiproc import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", mode, "--out", str(out),
               *(["--counts"] if counts else []), *args.forward]
        env = {"OMP_NUM_THREADS": "1"}
        if mode == "jax_fsdp":
            env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                " --xla_force_host_platform_device_count=2").strip()
        (code,), (log,) = launch(cmd, 1, env, timeout=900)  # one process, a fresh one
        if code != 0 or not out.exists():
            print(f"{mode}: failed (exit {code})\n{log[-3000:]}", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def table(results: dict[str, dict]) -> str:
    med = {m: 1e3 * statistics.median(r["times"]) for m, r in results.items()}

    def ratio(mode: str, peer: str) -> str:
        return f"{med[mode] / med[peer]:.2f}" if peer in med else "-"

    lines = ["| mode | ms/step | vs torch | vs fsdp2 | calls/unit | device ops/unit (alloc, "
             "copy, kernel, collective, host read, dlpack) |", "|" + "---|" * 6]
    jax_rows = [m for m in results if m in JAX]
    for mode, r in results.items():
        if mode in JAX:
            continue
        units = r.get("units")
        calls = f"{r['calls'] / units:.0f}" if "calls" in r and units else "-"
        ops_col = "-"
        if "ops" in r and units:
            per = [r["ops"][k] / units for k in KINDS]
            ops_col = f"{sum(per):.1f} ({', '.join(f'{x:.1f}' for x in per)})"
        lines.append(f"| {mode} | {med[mode]:.2f} | {ratio(mode, 'torch')} | "
                     f"{ratio(mode, 'fsdp2')} | {calls} | {ops_col} |")
    if jax_rows:
        lines += ["", "| JAX mode | ms/step | vs jax | vs jax_fsdp | forward ms | backward ms | "
                  "backward / forward |", "|" + "---|" * 7]
        for mode in jax_rows:
            split = results[mode].get("split")
            fb = (f"{split['forward']:.2f} | {split['backward']:.2f} | "
                  f"{split['backward'] / max(split['forward'], 1e-9):.2f}") if split else \
                "- | - | -"
            lines.append(f"| {mode} | {med[mode]:.2f} | {ratio(mode, 'jax')} | "
                         f"{ratio(mode, 'jax_fsdp')} | {fb} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=[*PEERS, *OURS])
    p.add_argument("--threads", action="store_true", help="also zero0-3 on 2 thread ranks")
    p.add_argument("--jax", action="store_true", help="also the JAX rows (see the docstring)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--count-steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--counts", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.forward = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "steps", "warmup", "count_steps", "layers", "width", "heads", "seq", "batch", "vocab")]
    if args.worker:
        worker(args)
        return
    modes = (list(args.modes) + ([f"{m}x2" for m in OURS] if args.threads else [])
             + (list(JAX) if args.jax else []))
    results: dict[str, dict] = {}
    for n in range(args.passes):
        for mode in modes:
            r = run_mode(mode, args, counts=n == 0)
            if r is None:
                continue
            if mode in results:
                results[mode]["times"] += r["times"]
            else:
                results[mode] = r
            print(f"pass {n + 1}/{args.passes} {mode}: "
                  f"{1e3 * statistics.median(r['times']):.2f} ms", file=sys.stderr, flush=True)
    print(f"\n{shape(args)}, world 1 (gloo) unless x2 (thread ranks); medians over "
          f"{args.passes} passes of {args.steps} steps\n")
    print(table(results))


if __name__ == "__main__":
    main()
