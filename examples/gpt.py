"""A small GPT trained with ZeRO on CPU ranks.

The task is byte-level language modelling of Python's own standard library
sources (they ship with every Python, so nothing is downloaded).

Under torchrun (gloo, one process per rank):
    torchrun --nproc-per-node 2 examples/gpt.py --stage 3
With thread ranks in one process:
    python examples/gpt.py --stage 3 --threads 4
Checkpoints and resuming (the data stream continues where it stopped):
    torchrun --nproc-per-node 2 examples/gpt.py --steps 1000 --save runs/gpt
    torchrun --nproc-per-node 3 examples/gpt.py --steps 1500 --save runs/gpt --resume
From Python (a notebook): ``examples.gpt.GPT``, ``corpus``, ``sample_batch``,
``train`` and ``generate``.
"""

from __future__ import annotations

import argparse
import copy
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import interop.torch as it  # noqa: E402
import ops  # noqa: E402
import shard  # noqa: E402

STDLIB_MODULES = ("argparse", "collections/__init__", "dataclasses", "functools", "inspect",
                  "json/decoder", "json/encoder", "logging/__init__", "pathlib", "typing")


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    d: int = 128
    layers: int = 4
    heads: int = 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d), nn.LayerNorm(cfg.d)
        self.qkv, self.proj = nn.Linear(cfg.d, 3 * cfg.d), nn.Linear(cfg.d, cfg.d)
        self.fc, self.out = nn.Linear(cfg.d, 4 * cfg.d), nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hs = d // self.heads
        # thirds and heads counted from qkv's width: under tensor parallelism
        # (GPT._tp_plan) a rank's qkv gives its heads' q, k and v
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)  # each (B, T, nh hs)
        q, k, v = (z.view(b, t, -1, hs).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~mask[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, blocks, a final norm, and an output head
    tied to the token embedding; the causal mask is a buffer.

    ``_tp_plan`` is its tensor-parallel plan for ``interop.torch.parallelize``
    (Megatron's split: heads and MLP columns, then rows; the vocabulary).
    """

    _tp_plan: ClassVar[dict] = {"tok_emb": "embedding_rowwise",
                                "blocks.*.qkv": ("packed_colwise", 3),
                                "blocks.*.proj": "rowwise",
                                "blocks.*.fc": "colwise",
                                "blocks.*.out": "rowwise",
                                "head": "colwise_gather_output"}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.register_buffer("mask", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).tril(),
                             persistent=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln_f(x))  # (B, T, vocab)


class Embed(nn.Module):
    """The token and position embeddings: a pipeline's first layer."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))


class MaskedBlock(nn.Module):
    """A block with its own copy of the causal mask (a non-persistent buffer)."""

    def __init__(self, block: Block, mask: torch.Tensor) -> None:
        super().__init__()
        self.block = block
        self.register_buffer("mask", mask.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, self.mask)


class Head(nn.Module):
    """The final norm and the output head, with its own copy of the token
    embedding's weight: ``tied_weights`` names the pair for ``shard.pipeline``."""

    def __init__(self, ln_f: nn.LayerNorm, weight: torch.Tensor) -> None:
        super().__init__()
        self.ln_f = ln_f
        self.head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.head.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def chain(model: GPT) -> list[nn.Module]:
    """The model as a chain of modules for ``interop.torch.layered`` and
    ``shard.pipeline``: embeddings, each block, then the norm and head. It shares
    the model's parameters except the head's weight, a copy tied to the token
    embedding by ``tied_weights``."""
    return [Embed(model.tok_emb, model.pos_emb),
            *(MaskedBlock(b, model.mask) for b in model.blocks),
            Head(model.ln_f, model.tok_emb.weight)]


def tied_weights(cfg: GPTConfig) -> list[list[tuple[int, str]]]:
    """``shard.pipeline(tied=...)`` for :func:`chain`: the token embedding is the head."""
    return [[(0, "tok_emb.weight"), (cfg.layers + 1, "head.weight")]]


CHAIN_TP_PLAN = {"tok_emb": "embedding_rowwise", "block.qkv": ("packed_colwise", 3),
                 "block.proj": "rowwise", "block.fc": "colwise", "block.out": "rowwise",
                 "head": "colwise_gather_output"}
"""``GPT._tp_plan`` for :func:`chain`'s layers: ``interop.torch.parallelize(chain(model),
mesh, CHAIN_TP_PLAN)``."""


def chain_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """:func:`lm_loss` from the chain's output."""
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def lm_loss(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def corpus() -> np.ndarray:
    """Bytes of some standard library modules' sources (about 700 KB)."""
    lib = Path(argparse.__file__).parent
    text = b"".join((lib / f"{m}.py").read_bytes() for m in STDLIB_MODULES)
    return np.frombuffer(text, np.uint8)


class Windows:
    """The corpus as a map-style dataset for :class:`shard.DataLoader`: window
    ``i`` is the bytes ``[i * seq, (i + 1) * seq + 1)``, as (inputs, next bytes)."""

    def __init__(self, data: np.ndarray, seq: int) -> None:
        self.data, self.seq = data, seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(self.data[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return idx[:-1], idx[1:]


def sample_batch(data: np.ndarray, step: int, batch: int, seq: int,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank (split it per rank)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, batch)
    idx = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(idx[:, :-1]), torch.from_numpy(idx[:, 1:])


def local_part(b: tuple[torch.Tensor, torch.Tensor], comm: ops.Communicator) -> tuple:
    n = b[0].shape[0] // comm.world_size
    return tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b)


ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def train(comm: ops.Communicator, *, stage: int = 3, steps: int = 200, batch: int = 16,
          cfg: GPTConfig = GPTConfig(), lr: float = 3e-3, model: GPT | None = None,
          progress: bool = True, save: str | Path | None = None, save_every: int = 500,
          resume: bool = False, replicas: int = 1,
          reshard_after_forward: bool | int = True,
          invariant_shards: int | None = None, quantized_weights: bool = False,
          quantized_gradients: bool | int = False,
          onebit_freeze_step: int | None = None, zero_one: dict | None = None,
          on_step: Callable[[int], None] | None = None) -> dict:
    """Train a GPT with ZeRO ``stage`` up to step ``steps``; returns losses,
    timings and memory.

    Every rank must start from the same weights: pass ``model`` (each rank
    trains a deep copy) when ranks are threads, which share torch's RNG.
    The batches are a :class:`shard.DataLoader`'s over the corpus's windows
    (``batch`` of them a step, shuffled every epoch). ``save``: a directory;
    the checkpoint ``<save>/checkpoint`` is written every ``save_every`` steps
    (``shard.async_save``: the next steps run while the files are written) and
    at the end (``shard.save``), and ``<save>/metrics.csv`` logs every 10th
    step. ``resume``: continue from that checkpoint (any world size or stage),
    the loader where the run stopped (``loader.resume(state)``). ``replicas``: hierarchical
    ZeRO (HSDP) over ``shard.Mesh(comm, {"replicate": replicas, "shard": ...})``;
    with one replica per node, ZeRO's gathers stay inside each node.
    ``reshard_after_forward``: ZeRO-3 over every rank with each unit's
    secondary shard kept inside groups of that many ranks (the ranks per node;
    ZeRO++'s hpZ), so only the forward's gathers cross nodes, once.
    ``invariant_shards``: the same bits at any number of ranks dividing it
    (``shard.ZeroOptions(invariant_shards=...)``): a run may resume on
    another world size and keep its trajectory exactly. ``quantized_weights``:
    stage 3's gathers move int8 params with a scale per block (ZeRO++'s qwZ).
    ``quantized_gradients``: the gradients' reduce-scatter moves int8 (or with
    ``4`` int4) with a scale per block (ZeRO++'s qgZ; with
    ``reshard_after_forward``, exact inside each group and quantized across).
    ``onebit_freeze_step``: 1-bit Adam (``ops.onebit_adam``, stages 1-2) with
    that ``freeze_step`` instead of AdamW, without clipping. ``zero_one``: 0/1
    Adam (``ops.zero_one_adam``, stages 1-2) with these keyword arguments
    (``var_freeze_step``, ``local_step_clipper``, ...), without clipping.
    ``on_step(done)``: called after each step with the steps done.
    """
    model = copy.deepcopy(model) if model is not None else build(cfg)
    params, loss = it.functional(model, loss=lm_loss)
    loggers = [shard.CSVLogger(Path(save) / "metrics.csv", every=10)] if save else []
    mesh = shard.Mesh(comm, {"replicate": replicas, "shard": comm.world_size // replicas}
                      if replicas > 1 else {"data": comm.world_size})
    zero_comm = mesh["shard" if replicas > 1 else "data"]  # what ZeRO shards over
    optimizer = (ops.onebit_adam(lr, freeze_step=onebit_freeze_step, weight_decay=0.01)
                 if onebit_freeze_step is not None else
                 ops.zero_one_adam(lr, weight_decay=0.01, **zero_one) if zero_one is not None
                 else ops.adamw(lr, weight_decay=0.01))
    step = ZERO[stage](loss, optimizer=optimizer, mesh=mesh,
                       clip_norm=1.0 if onebit_freeze_step is None and zero_one is None
                       else None,
                       options=shard.ZeroOptions(
                           loggers=loggers, reshard_after_forward=reshard_after_forward,
                           invariant_shards=invariant_shards,
                           quantized_weights=quantized_weights,
                           quantized_gradients=quantized_gradients))
    loader = shard.DataLoader(Windows(corpus(), cfg.seq), batch, mesh=mesh)
    state = step.init(params)
    ckpt = Path(save) / "checkpoint" if save else None
    if resume and ckpt is not None and (ckpt / "manifest.json").exists():
        state, _ = shard.load(ckpt, step, comm=zero_comm)
        loader.resume(state)
        if comm.rank == 0:
            print(f"resumed from {ckpt} at step {int(state.batches)}")
    first = int(state.batches)
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=first, desc=f"ZeRO-{stage} x{comm.world_size}",
                   unit="step")
    losses, t0 = [], time.perf_counter()
    local_tokens = batch // comm.world_size * cfg.seq
    while int(state.batches) < steps:
        for b in loader:  # to the end of the epoch
            state, metrics = step(state, b, tokens=local_tokens)
            done = int(state.batches)
            losses.append(metrics["loss"])
            if on_step is not None:
                on_step(done)
            if bar is not None:
                bar.set_postfix(loss=f"{metrics['loss']:.3f}",
                                tok_s=f"{metrics['tokens_per_s'] * comm.world_size:,.0f}")
                bar.update()
            if ckpt is not None and done == steps:  # waits for an async save still writing
                shard.save(state, ckpt, comm=zero_comm)
            elif ckpt is not None and done % save_every == 0:
                shard.async_save(state, ckpt, comm=zero_comm)
            if done == steps:
                break
    if bar is not None:
        bar.close()
    for logger in loggers:
        logger.close()
    return {"losses": losses, "seconds": time.perf_counter() - t0, "state_bytes": state.nbytes(),
            "stage": stage, "first_step": first,
            "peak_unit_bytes": step.tracker.peak, "state": state, "step": step,
            "module": model,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


@torch.no_grad()
def generate(model: GPT, prompt: bytes, n: int, *, temperature: float = 0.8,
             seed: int = 0) -> bytes:
    """``n`` bytes sampled from ``model`` after ``prompt``."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.int64)
    for _ in range(n):
        logits = model(idx[:, -model.cfg.seq:])[0, -1] / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        idx = torch.cat([idx, nxt[None]], dim=1)
    return bytes(idx[0, len(prompt):].tolist())


def memory_table(comm: ops.Communicator, result: dict, cfg: GPTConfig) -> str:
    """Per-rank bytes by kind: this run's state (measured) next to plain data
    parallelism (``estimate_memory``, which the tests hold equal to a state's bytes)."""
    params, fn = it.functional(GPT(cfg), loss=lm_loss)
    ddp = shard.estimate_memory(params, stage=0, world_size=comm.world_size, units=fn.units)
    ours = result["state_bytes"]
    shards = result["step"].config.comm.world_size  # with replicas, each node's ranks
    ours_grads = shard.estimate_memory(params, stage=result["stage"], world_size=shards,
                                       units=fn.units)["grads"]
    rows = [(kind, ours[kind], ddp[kind]) for kind in ours]
    rows.append(("grads (in a step)", ours_grads, ddp["grads"]))
    rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    lines = [f"{'per-rank bytes':<22}{'this run':>12}{'plain DP':>12}",
             *(f"{k:<22}{a / 2**20:>10.2f}Mi{b / 2**20:>10.2f}Mi" for k, a, b in rows),
             f"{'peak gathered units':<22}{result['peak_unit_bytes'] / 2**20:>10.2f}Mi",
             f"{'peak RSS (process)':<22}{result['rss_mib']:>10.0f}Mi"]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line's flags."""
    # Full names only: torchrun reads abbreviations of its own flags after the script's
    # name (--d would be its --duplicate-stdout-filters), and so would this parser.
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--d-model", type=int, default=128, help="the GPT's width")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=0,
                    help="run N thread ranks in this process instead of under torchrun")
    ap.add_argument("--save", default=None,
                    help="directory for the checkpoint and metrics.csv (none by default)")
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--resume", action="store_true",
                    help="continue from <save>/checkpoint when it exists")
    ap.add_argument("--replicas", type=int, default=1,
                    help="hierarchical ZeRO: ZeRO inside groups of world/replicas ranks "
                         "(a node each), replicated across them")
    ap.add_argument("--reshard-after-forward", type=int, default=0, metavar="RANKS",
                    help="ZeRO-3 with each unit's secondary shard inside groups of RANKS "
                         "ranks (the ranks per node; ZeRO++'s hpZ); 0: off")
    ap.add_argument("--invariant-shards", type=int, default=0, metavar="V",
                    help="the same bits at any number of ranks dividing V (a power of two "
                         "dividing the batch): resume on another world size exactly; 0: off")
    ap.add_argument("--quantized-weights", action="store_true",
                    help="stage 3: all-gather the params as int8 with a scale per block "
                         "(ZeRO++'s qwZ)")
    ap.add_argument("--quantized-gradients", type=int, nargs="?", const=8, default=0,
                    choices=(8, 4), metavar="BITS",
                    help="stages 1-3: reduce-scatter the gradients as int8 (or int4: 4) with "
                         "a scale per block (ZeRO++'s qgZ)")
    ap.add_argument("--onebit-adam", type=int, default=0, metavar="FREEZE_STEP",
                    help="stages 1-2: 1-bit Adam, its momentum sent compressed after "
                         "FREEZE_STEP updates (no clipping); 0: AdamW")
    ap.add_argument("--zero-one-adam", type=int, default=0, metavar="VAR_FREEZE_STEP",
                    help="stages 1-2: 0/1 Adam, its variance frozen after VAR_FREEZE_STEP "
                         "updates and local steps from there (no clipping); 0: AdamW")
    ap.add_argument("--local-step-scaler", type=int, default=32678, metavar="N",
                    help="0/1 Adam: the updates between doublings of the local steps' interval")
    ap.add_argument("--local-step-clipper", type=int, default=16, metavar="H",
                    help="0/1 Adam: the local steps' largest interval")
    ap.add_argument("--sample", type=int, default=200,
                    help="bytes of text to generate at the end (0: none)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    cfg = GPTConfig(d=args.d_model, layers=args.layers)
    torch.set_num_threads(1)

    model = build(cfg)

    def run(comm: ops.Communicator) -> None:
        result = train(comm, stage=args.stage, steps=args.steps, batch=args.batch, cfg=cfg,
                       lr=args.lr, model=model, save=args.save, save_every=args.save_every,
                       resume=args.resume, replicas=args.replicas,
                       reshard_after_forward=args.reshard_after_forward or True,
                       invariant_shards=args.invariant_shards or None,
                       quantized_weights=args.quantized_weights,
                       quantized_gradients=args.quantized_gradients or False,
                       onebit_freeze_step=args.onebit_adam or None,
                       zero_one={"var_freeze_step": args.zero_one_adam,
                                 "local_step_scaler": args.local_step_scaler,
                                 "local_step_clipper": args.local_step_clipper}
                       if args.zero_one_adam else None)
        table = memory_table(comm, result, cfg)
        if args.sample:  # every rank gathers (a collective); rank 0 samples
            it.load_state(result["module"], result["state"], comm=result["step"].config.comm)
        if comm.rank == 0 and result["losses"]:
            first = float(np.mean(result["losses"][:10]))
            last = float(np.mean(result["losses"][-10:]))
            print(f"\nloss {first:.3f} -> {last:.3f} (mean of the first and last 10 steps of "
                  f"steps {result['first_step']}-{args.steps}) in {result['seconds']:.0f} s on "
                  f"{comm.world_size} {comm.backend} ranks\n")
            print(table)
        if comm.rank == 0 and args.sample:
            prompt = b"def "
            text = prompt + generate(result["module"], prompt, args.sample)
            print("\nsample:\n" + text.decode("utf-8", errors="replace"))

    if args.threads:
        ops.spawn(run, args.threads)
    else:
        run(ops.init_from_env())


if __name__ == "__main__":
    main()
