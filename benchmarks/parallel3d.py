"""Tensor parallelism: ours (``interop.torch.parallelize`` + a ZeRO step) against
torch's (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``,
and FSDP2 + TP on a 2-D ``DeviceMesh``), side by side on gloo CPU processes.

    python benchmarks/parallel3d.py [--layouts 1x2,2x2] [--steps 8] [--rounds 2]

The model is a Hugging Face ``LlamaForCausalLM`` (untied head), split the same way
by both: q/k/v and gate/up column-parallel, o/down row-parallel, the embedding
vocabulary-parallel and the head column-parallel with its output gathered
(Hugging Face's own ``_tp_plan``). A layout ``DxT`` is D data ranks by T model
ranks, one process each (one compute thread): at D = 1 ours runs
``zero1`` on a ``data`` x ``model`` mesh against ``parallelize_module`` and
``torch.optim.AdamW``; at D > 1 ours runs ``zero3`` on the data axis against FSDP2
(``fully_shard`` per decoder layer and the root) on the ``data`` dimension of a
2-D mesh. Reported per layout: the slowest rank's median ms/step, ours over
torch's, the bytes ours moves between model ranks per step and rank (payloads
handed to the model axis's collectives, counted on its communicator) against
the analytic count, and each rank's peak resident memory (``ru_maxrss``).

The analytic count, for B rows per data rank, S tokens, hidden d, vocabulary V,
L layers and float32: every all-reduce moves an activation of B S d elements
(forward: the embedding's and each layer's two row-parallel outputs; backward:
each column-parallel layer's input gradient, five a layer, and the head's), so
``(7 L + 2) B S d``, and the head's output all-gather ``B S V / T``, plus the
step's one all-reduce of the gradient norm's sum of squares (8 bytes); torch's
split issues the same collectives (its per-step counts by kind are printed,
from ``CommDebugMode``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build(args: argparse.Namespace) -> tuple:
    """The model (the same on every rank) and one batch of token ids."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator()
                        .manual_seed(1))
    return model, ids


def _rows(ids: object, rank: int, data: int) -> object:
    n = ids.shape[0] // data
    return ids[rank * n:(rank + 1) * n]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ours(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    import interop.torch as it
    import ops
    import shard

    torch.set_num_threads(1)
    comm = ops.init_from_env()
    data = comm.world_size // args.model
    mesh = shard.Mesh(comm, {"data": data, "model": args.model})
    moved = {"bytes": 0, "calls": 0}
    axis = mesh["model"]

    def counting(f: object, payload: int) -> object:
        def counted(*a: object, **kw: object) -> object:
            moved["bytes"] += a[payload].nbytes  # the input: all_reduce_(x), *_into(out, x)
            moved["calls"] += 1
            return f(*a, **kw)
        return counted

    for name, payload in (("all_reduce_", 0), ("all_gather_into", 1),
                          ("reduce_scatter_into", 1)):
        setattr(axis, name, counting(getattr(axis, name), payload))
    model, ids = build(args)
    it.parallelize(model, mesh)  # the model's own plan; the step reads it from the loss
    params, loss = it.functional(model, loss=lambda m, b: m(input_ids=b, labels=b).loss)
    zero = shard.zero1 if data == 1 else shard.zero3
    step = zero(loss, optimizer=ops.adamw(1e-4), mesh=mesh)
    state = step.init(params)
    mine = _rows(ids, mesh.coords["data"], data)
    times, per_step = [], []
    for i in range(args.steps + 2):
        before = moved["bytes"]
        state, m = step(state, mine)
        if i >= 2:  # after warming up
            times.append(m["time_ms"]["step"])
            per_step.append(moved["bytes"] - before)
    every = ops.all_gather(comm, np.array([statistics.median(times), _peak_mib()]))
    return {"step_ms": float(np.max(every[0::2])), "peak_mib": every[1::2].tolist(),
            "bytes": per_step[-1], "calls": moved["calls"] // (args.steps + 2),
            "loss": float(m["loss"])}


def torch_tp(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    w = dist.get_world_size()
    data = w // args.model
    mesh = init_device_mesh("cpu", (data, args.model), mesh_dim_names=("data", "model"))
    model, ids = build(args)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(args.layers):
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj"):
            plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
    parallelize_module(model, mesh["model"], plan)
    if data > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["data"])
        fully_shard(model, mesh=mesh["data"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mine = _rows(ids, mesh.get_coordinate()[0], data)
    times, counts = [], {}
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        debug = CommDebugMode() if i == 1 else None
        with debug or _nothing():
            opt.zero_grad()
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            opt.step()
        if debug is not None:
            counts = {str(k).rsplit(".", 1)[-1]: v for k, v in debug.get_comm_counts().items()}
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - t0))
    every = [torch.zeros(2) for _ in range(w)]
    dist.all_gather(every, torch.tensor([statistics.median(times), _peak_mib()]))
    return {"step_ms": max(float(t[0]) for t in every),
            "peak_mib": [float(t[1]) for t in every], "counts": counts,
            "loss": float(loss.detach())}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


WORKERS = {"ours": ours, "torch": torch_tp}


def run(framework: str, data: int, model: int, args: argparse.Namespace) -> dict:
    from tests.multiproc import launch

    cmd = [sys.executable, __file__, "--worker", framework, "--model", str(model)]
    for k in ("layers", "hidden", "ffn", "heads", "vocab", "seq", "batch", "steps"):
        cmd += [f"--{k}", str(getattr(args, k))]
    codes, logs = launch(cmd, data * model, dict(
        OMP_NUM_THREADS="1",
        XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"),
        timeout=3600)
    line = [x for x in logs[0].splitlines() if x.startswith("RESULT ")]
    if any(codes) or not line:
        raise RuntimeError(f"{framework} {data}x{model} failed:\n"
                           + "\n".join(log[-3000:] for log in logs))
    return json.loads(line[0][len("RESULT "):])


def analytic_bytes(args: argparse.Namespace, data: int, model: int) -> int:
    """Payload bytes into the model axis's collectives per step and rank (and the
    8 bytes of the gradient norm's float64 sum of squares)."""
    rows = args.batch // data
    act = rows * args.seq * args.hidden
    return 4 * ((7 * args.layers + 2) * act + rows * args.seq * args.vocab // model) + 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1x2,2x2", help="DxT: data ranks x model ranks")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2,
                    help="each layout runs ours and torch's this many times, interleaved")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = WORKERS[args.worker](args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        sys.stdout.flush()
        os._exit(0)
    layouts = [tuple(int(x) for x in s.split("x")) for s in args.layouts.split(",")]
    print(f"Llama: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.heads} "
          f"heads, vocab {args.vocab}, seq {args.seq}, batch {args.batch}; medians of "
          f"{args.steps} steps, {args.rounds} rounds; {os.cpu_count()} cores", flush=True)
    head = ["D x T", "ours ms", "torch ms", "ours / torch", "ours bytes/step/rank",
            "analytic", "ours peak MiB", "torch peak MiB", "torch collectives/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for data, model in layouts:
        got: dict[str, list[dict]] = {"ours": [], "torch": []}
        for _ in range(args.rounds):
            for f in ("ours", "torch"):
                got[f].append(run(f, data, model, args))
                print(f"  {data}x{model} {f}: {got[f][-1]['step_ms']:.1f} ms", flush=True)
        ratios = [o["step_ms"] / t["step_ms"] for o, t in zip(got["ours"], got["torch"],
                                                               strict=True)]
        o, t = got["ours"][-1], got["torch"][-1]
        lines.append("| " + " | ".join([
            f"{data} x {model}",
            f"{statistics.median(r['step_ms'] for r in got['ours']):.1f}",
            f"{statistics.median(r['step_ms'] for r in got['torch']):.1f}",
            f"{statistics.median(ratios):.2f}",
            f"{o['bytes']:,}", f"{analytic_bytes(args, data, model):,}",
            f"{max(o['peak_mib']):.0f}", f"{max(t['peak_mib']):.0f}",
            ", ".join(f"{k} {v}" for k, v in sorted(t["counts"].items()))]) + " |")
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
