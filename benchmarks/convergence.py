"""Convergence with ZeRO++'s compressed collectives: the demo GPT's loss curve
with qwZ, qgZ and both (with hpZ) against exact ZeRO-3.

``examples/gpt.py``'s GPT (byte-level language modelling of Python's standard
library sources) trains ``--steps`` steps on ``--ranks`` thread ranks, from
the same weights on the same batches, once per mode:

- ``exact``: ZeRO-3;
- ``qwz``: ``quantized_weights=True`` (int8 all-gathers of the params);
- ``qgz``: ``quantized_gradients=True`` (int8 all-to-all reduction of the
  gradients); ``qgz4``: ``quantized_gradients=4`` (int4);
- ``hpz-qwz-qgz``: both, with ``reshard_after_forward=--group`` (ZeRO++);
  ``hpz-qwz-qgz4``: with int4 gradients;
- ``exact-half``: exact ZeRO-3 on half the ranks, the same global batches:
  the exact run with its floating-point sums in another order, whose gap is
  the noise floor the others are read against (training amplifies any
  difference in the last bits into a different trajectory);
- ``onebit``: ZeRO-2 with 1-bit Adam (``ops.onebit_adam``, no clipping), its
  momentum compressed after ``--freeze-step`` updates, read against
  ``onebit-warm``: the same optimizer never leaving its warm-up (Adam
  without bias correction, exact gradients);
- ``zeroone``: ZeRO-2 with 0/1 Adam (``ops.zero_one_adam``, no clipping), its
  variance updated on DeepSpeed's schedule (``var_update_scaler=16``) until
  ``--freeze-step``, the other updates' gradients compressed, then local
  steps synchronised every 1, 2, then 4 updates (``local_step_scaler=25``,
  ``local_step_clipper=4``), read against ``onebit-warm`` too.

The table gives each mode's mean loss over the last ``--tail`` steps and its
gap to its reference's (the exact run's, or ``onebit-warm``'s), in percent;
``--plot`` draws the curves (a moving mean over 10 steps) into a PNG file.

Usage: python benchmarks/convergence.py [--steps 300] [--ranks 4] [--plot curves.png]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ops  # noqa: E402
from examples import gpt  # noqa: E402

MODES = {"exact": {}, "qwz": {"quantized_weights": True},
         "qgz": {"quantized_gradients": True}, "qgz4": {"quantized_gradients": 4},
         "hpz-qwz-qgz": {"quantized_weights": True, "quantized_gradients": True,
                         "reshard_after_forward": None},
         "hpz-qwz-qgz4": {"quantized_weights": True, "quantized_gradients": 4,
                          "reshard_after_forward": None},
         "exact-half": {}, "onebit-warm": {"stage": 2, "onebit_freeze_step": 10**9},
         "onebit": {"stage": 2, "onebit_freeze_step": None},
         "zeroone": {"stage": 2, "zero_one": None}}
REFERENCE = {"onebit": "onebit-warm", "zeroone": "onebit-warm"}  # the others': "exact"


def run(mode: str, args: argparse.Namespace, model: gpt.GPT, cfg: gpt.GPTConfig) -> tuple:
    options = dict(MODES[mode])
    if "reshard_after_forward" in options:
        options["reshard_after_forward"] = args.group
    if options.get("onebit_freeze_step", 0) is None:
        options["onebit_freeze_step"] = args.freeze_step
    if "zero_one" in options:
        options["zero_one"] = {"var_freeze_step": args.freeze_step, "local_step_scaler": 25,
                               "local_step_clipper": 4}
    options.setdefault("stage", 3)
    ranks = args.ranks // 2 if mode == "exact-half" else args.ranks
    t0 = time.perf_counter()
    out = ops.spawn(lambda comm: gpt.train(comm, steps=args.steps, batch=args.batch,
                                           cfg=cfg, model=model, progress=False, **options),
                    ranks)
    return np.asarray(out[0]["losses"], np.float64), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--group", type=int, default=2,
                    help="hpZ's ranks per node in the hpz-qwz-qgz mode")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tail", type=int, default=50, help="steps the final loss averages")
    ap.add_argument("--freeze-step", type=int, default=200,
                    help="1-bit Adam's warm-up updates in the onebit mode, 0/1 Adam's "
                         "var_freeze_step in the zeroone mode")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--plot", type=Path, help="write the curves to this PNG file")
    args = ap.parse_args()
    modes = ["exact", *[m for m in args.modes if m != "exact"]]
    for mode in ("onebit", "zeroone"):
        if mode in modes and "onebit-warm" not in modes:
            modes.insert(modes.index(mode), "onebit-warm")
    cfg = gpt.GPTConfig(d=args.d_model, layers=args.layers)
    import torch

    torch.set_num_threads(1)
    model = gpt.build(cfg)
    curves, seconds = {}, {}
    for mode in modes:
        curves[mode], seconds[mode] = run(mode, args, model, cfg)
        print(f"{mode}: {seconds[mode]:.0f} s, loss {curves[mode][0]:.3f} -> "
              f"{curves[mode][-args.tail:].mean():.4f}", flush=True)
    tail = min(args.tail, args.steps)
    print(f"\nGPT d={args.d_model} layers={args.layers}, {args.ranks} thread ranks, batch "
          f"{args.batch}, {args.steps} steps; the final loss is the mean of the last {tail}\n")
    print("| mode | final loss | reference | gap to it | largest gap of a step | seconds |")
    print("|---|---|---|---|---|---|")
    for mode in modes:
        ref = REFERENCE.get(mode, "exact")
        final, base = curves[mode][-tail:].mean(), curves[ref][-tail:].mean()
        worst = np.abs(curves[mode] / curves[ref] - 1).max()
        print(f"| {mode} | {final:.4f} | {ref} | {100 * (final / base - 1):+.2f}% | "
              f"{100 * worst:.2f}% | {seconds[mode]:.0f} |")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.6))
        window = min(10, args.steps)
        for mode in modes:
            smooth = np.convolve(curves[mode], np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window, args.steps + 1), smooth, label=mode,
                    lw=2 if mode == "exact" else 1.2,
                    ls="-" if mode.startswith("exact") else "--",
                    color="0.6" if mode == "exact-half" else None)
        if "onebit" in modes or "zeroone" in modes:
            ax.axvline(args.freeze_step, color="0.7", lw=0.8, ls=":")
            ax.annotate("freeze_step", (args.freeze_step, ax.get_ylim()[1]),
                        fontsize=8, ha="right", va="top", rotation=90, color="0.4")
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss (mean of {window} steps)")
        ax.set_title(f"demo GPT on {args.ranks} ranks, exact and compressed (ZeRO-3; "
                     "1-bit and 0/1 Adam: ZeRO-2)", fontsize=10)
        fig.tight_layout(rect=(0, 0.14, 1, 1))  # the legend below, clear of the curves
        fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=8,
                   frameon=False)
        fig.savefig(args.plot, dpi=110)
        print(f"\ncurves: {args.plot}")


if __name__ == "__main__":
    main()
