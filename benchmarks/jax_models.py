"""JAX models as their authors write them: shard.zero3 against jax.jit FSDP.

Three models, each a plain JAX loss over the model library's own params:

  cnn    flax nnx's MNIST CNN (its tutorial's: two convolutions with average
         pooling, two linear layers), 28x28 images, batch 32
  bert   an equinox encoder (embedding, 4 blocks of eqx.nn.MultiheadAttention,
         LayerNorm and MLP, a linear head), width 128, sequence 32, batch 16;
         a unit per block (units=2)
  gpt    the GPT of benchmarks/overhead.py (12 blocks of width 64), batch 2

Two modes, each in a fresh process (so its first step compiles), modes
interleaved pass by pass; the table gives medians:

  jax_fsdp  one jax.jit of value_and_grad and optax.adamw over 2 host devices
            (XLA_FLAGS=--xla_force_host_platform_device_count=2), params
            sharded on their first dimension where it divides (NamedSharding
            over a "data" axis), the batch on its rows: what a JAX user has
  zero3x2   shard.zero3 on the same loss and 2 thread ranks, ops.adamw, each
            rank half the batch, placed as jax arrays before the clock as the
            others' are (the loss traced once and cut into one segment
            per unit: see [Note: traced units] in shard/step/_traced.py), units
            under 100,000 params joined to their neighbours (min_num_params)
  pure3x2   shard.pure_zero3 on the same loss, units and min_num_params and 2
            thread ranks, one optax.adamw for both, each step one call of the
            step (the ranks' one compiled program; its collectives are ordered
            host callbacks: see [Note: pure steps] in shard/_pure.py)

Columns: the first step's seconds (tracing and compiling included), the median
step after it, the ratio of each to jax_fsdp's, and for zero3x2 rank 0's peak
of gathered full params against the whole model's bytes.

Usage:
  python benchmarks/jax_models.py                 # about 4 minutes
  python benchmarks/jax_models.py --models cnn --passes 1 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.multiproc: the launches
MODELS = ("cnn", "bert", "gpt")
MODES = ("jax_fsdp", "zero3x2", "pure3x2")
LR, WD = 1e-3, 0.01
MIN_NUM_PARAMS = 100_000  # DeepSpeed's stage3_param_persistence_threshold


def cnn() -> tuple[Any, Any, Any, Any]:
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs) -> None:
            self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
            self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
            self.linear2 = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
            x = pool(nnx.relu(self.conv1(x)))
            x = pool(nnx.relu(self.conv2(x)))
            return self.linear2(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))

    graphdef, params = nnx.split(CNN(rngs=nnx.Rngs(0)))

    def loss(p: Any, b: Any) -> Any:
        logits = nnx.merge(graphdef, p)(b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def batch(i: int) -> Any:
        rng = np.random.default_rng(i)
        return {"x": rng.standard_normal((32, 28, 28, 1)).astype(np.float32),
                "y": rng.integers(0, 10, 32).astype(np.int32)}

    del jnp
    return params, loss, batch, None


def bert() -> tuple[Any, Any, Any, Any]:
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    d, vocab, seq, depth = 128, 1000, 32, 4

    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        norm1: eqx.nn.LayerNorm
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key: Any) -> None:
            k1, k2 = jax.random.split(key)
            self.attention = eqx.nn.MultiheadAttention(4, d, key=k1)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
            self.mlp = eqx.nn.MLP(d, d, 4 * d, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x: Any) -> Any:
            x = x + self.attention(*[jax.vmap(self.norm1)(x)] * 3)
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class Encoder(eqx.Module):
        embed: eqx.nn.Embedding
        layers: list
        head: eqx.nn.Linear

        def __init__(self, key: Any) -> None:
            keys = jax.random.split(key, depth + 2)
            self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
            self.layers = [Block(k) for k in keys[1:-1]]
            self.head = eqx.nn.Linear(d, 2, key=keys[-1])

        def __call__(self, ids: Any) -> Any:
            x = jax.vmap(self.embed)(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x.mean(axis=0))

    params, static = eqx.partition(Encoder(jax.random.key(0)), eqx.is_array)

    def loss(p: Any, b: Any) -> Any:
        logits = jax.vmap(eqx.combine(p, static))(b["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def batch(i: int) -> Any:
        rng = np.random.default_rng(i)
        return {"ids": rng.integers(0, vocab, (16, seq)).astype(np.int32),
                "y": rng.integers(0, 2, 16).astype(np.int32)}

    return params, loss, batch, 2


def gpt() -> tuple[Any, Any, Any, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    import overhead

    args = argparse.Namespace(width=64, vocab=256, seq=16, heads=4, layers=12, batch=2)
    params, _, loss = overhead.jax_gpt(args)

    def batch(i: int) -> Any:
        rng = np.random.default_rng(i)
        tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
        return tokens[:, :-1], tokens[:, 1:]

    return params, loss, batch, None


BUILD = {"cnn": cnn, "bert": bert, "gpt": gpt}


def nbytes(tree: Any) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def run_jax_fsdp(model: str, steps: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from overhead import fsdp_placed, optax_step

    params, loss, batch, _ = BUILD[model]()
    params, place = fsdp_placed(params)
    step = optax_step(params, loss, lambda b: b)  # the batch placed before the clock
    times = []
    for i in range(steps + 1):
        b = place(batch(i))
        t = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t)
    return {"first": times[0], "times": times[1:]}


def run_zero3(model: str, steps: int) -> dict[str, Any]:
    import jax

    import ops
    import shard

    params, loss, batch, units = BUILD[model]()
    whole = nbytes(params)

    def run(comm: Any) -> dict[str, Any]:
        step = shard.zero3(loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                           options=shard.ZeroOptions(units=units,
                                                     min_num_params=MIN_NUM_PARAMS))
        state = step.init(params)
        times = []
        for i in range(steps + 1):
            b = jax.tree_util.tree_map(jax.numpy.asarray, shard.split_batch(
                batch(i), rank=comm.rank, world_size=2))  # placed before the clock, as
            comm.barrier()  # jax_fsdp's and pure3x2's are
            t = time.perf_counter()
            state, metrics = step(state, b)
            float(metrics["loss"])
            times.append(time.perf_counter() - t)
        return {"first": times[0], "times": times[1:], "peak": step.tracker.peak / whole}

    return ops.spawn(run, 2)[0]


def run_pure(model: str, steps: int) -> dict[str, Any]:
    import jax
    import optax

    import ops
    import shard

    params, loss, batch, units = BUILD[model]()
    tx = optax.adamw(LR, weight_decay=WD)  # one for both ranks: one compiled program

    def run(comm: Any) -> dict[str, Any]:
        step = shard.pure_zero3(loss, optimizer=tx, comm=comm, units=units,
                                min_num_params=MIN_NUM_PARAMS)
        state = step.init(params)
        times = []
        for i in range(steps + 1):
            b = jax.tree_util.tree_map(jax.numpy.asarray, shard.split_batch(
                batch(i), rank=comm.rank, world_size=2))
            comm.barrier()
            t = time.perf_counter()
            state, metrics = step(state, b)
            float(metrics["loss"])
            times.append(time.perf_counter() - t)
        return {"first": times[0], "times": times[1:]}

    return ops.spawn(run, 2)[0]


def worker(model: str, mode: str, steps: int) -> None:
    out = {"jax_fsdp": run_jax_fsdp, "zero3x2": run_zero3, "pure3x2": run_pure}[mode](
        model, steps)
    print("RESULT " + json.dumps(out))


def launch(model: str, mode: str, steps: int) -> dict[str, Any]:
    from tests.multiproc import launch as start

    (code,), (log,) = start([sys.executable, __file__, "--worker", model, mode, str(steps)], 1,
                            {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
                            timeout=3600)
    lines = [x for x in log.splitlines() if x.startswith("RESULT ")]
    if code or not lines:
        raise RuntimeError(f"{model} {mode} failed:\n{log[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    got: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.passes):
        for model in args.models:
            for mode in MODES:
                r = launch(model, mode, args.steps)
                got.setdefault((model, mode), []).append(r)
                print(f"pass {i + 1}/{args.passes} {model} {mode}: first {r['first']:.2f} s, "
                      f"step {1e3 * statistics.median(r['times']):.2f} ms", flush=True)
    print(f"\n2 ranks (jax_fsdp: 2 host devices; zero3x2, pure3x2: 2 thread ranks); medians over "
          f"{args.passes} passes of {args.steps} steps after the first\n")
    print("| model | mode | first step s | vs jax_fsdp | ms/step | vs jax_fsdp | "
          "peak gathered / model |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        base = got[(model, "jax_fsdp")]
        base_first = statistics.median(r["first"] for r in base)
        base_step = statistics.median(statistics.median(r["times"]) for r in base)
        for mode in MODES:
            rs = got[(model, mode)]
            first = statistics.median(r["first"] for r in rs)
            step = statistics.median(statistics.median(r["times"]) for r in rs)
            peak = f"{statistics.median(r['peak'] for r in rs):.2f}" if "peak" in rs[0] else "-"
            print(f"| {model} | {mode} | {first:.2f} | {first / base_first:.2f} | "
                  f"{1e3 * step:.2f} | {step / base_step:.2f} | {peak} |")


if __name__ == "__main__":
    main()
