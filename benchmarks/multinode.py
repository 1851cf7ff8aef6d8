"""Two hosts over a shaped link: flat ZeRO-3 against hierarchical ZeRO (HSDP),
ZeRO-3 with node-local secondary shards (hpZ), int8 gathers (qwZ) and int8
gradient reductions (qgZ).

Two network namespaces of this machine, joined by a veth link whose ends a
token bucket limits to ``--rate`` (1 Gbit/s by default), run ``examples/gpt.py``'s
GPT under torchrun, 2 processes each (``tests/netns_worker.py``): once as flat
ZeRO-3 over the 4 ranks, once with ZeRO-3 inside each host and the replicas
across (a ``replicate`` x ``shard`` mesh, see [Note: replicas]), and so on: one
launch a round trains every mode in turn in its one process group. The table
gives the median over ``--rounds`` of the seconds per step (the run's wall time
over its steps, the first included) and the bytes each host sent over its link
per step (read by the ranks from the link's counters around each mode's run,
its set-up included), against the analytic figures: flat ZeRO-3 sends about 3x the
params' bytes per host and step (each of a host's two ranks receives the
other host's half of every unit twice, 2x, and sends its gradients for the
other host's shards, 1x), HSDP about 1x (each rank all-reduces its
half-model gradient shard with its replica; no gather crosses the link), and
ZeRO-3 with ``reshard_after_forward=2`` (see [Note: secondary shards]) about
1.5x: each rank's shard of every unit crosses once, to its counterpart on the
other host (0.5x), and the gradients' reduce-scatter is flat ZeRO-3's (1x);
its optimizer state stays sharded over all 4 ranks, where HSDP's is over 2.
ZeRO-3 with ``quantized_weights=True`` (ZeRO++'s qwZ, see [Note: quantized
gathers]) gathers int8 values and a float32 scale per 256: its gathers send
``(1 + 4 / 256) / 4`` of flat ZeRO-3's float32 bytes, so about 2 x 0.254 +
1 = 1.5x the params' bytes. Both together (``hpz-qwz``) quantize the one gather
that crosses the link: about 0.5 x 0.254 + 1 = 1.13x.
ZeRO-3 with ``quantized_gradients=True`` (ZeRO++'s qgZ, see [Note: quantized
gradient reduction]) sends each rank's sections for the other host's ranks
as int8 and scales: the gradients' 1x becomes about 0.254x, so 2.25x in
all. With hpZ and qwZ as well (``hpz-qwz-qgz``, ZeRO++ whole) the gradients
are summed exactly inside each host first and each rank sends the other
host's half of its node sum, quantized: 0.5 x 0.254 = 0.13x for the
gathers and as much for the gradients, about 0.25x in all; with int4 gradients
(``hpz-qwz-qgz4``) 0.5 x 0.129 = 0.06x for them, about 0.19x in all.
ZeRO-2 (``zero2``, AdamW) reduce-scatters the gradients (1x) and all-gathers
the updated params (1x): about 2x. With 1-bit Adam (``zero2-onebit``,
``ops.onebit_adam``, its ``freeze_step`` the warm-up's last step but one)
the gradients' 1x becomes the compressed all-reduce of the momentum, 2 x
1/32 x (1 + 1/8) / 2 x 2 = about 0.07x, and every rank updates its whole
params from it, so no params are gathered either: about 0.07x a step after
the warm-up. With 0/1 Adam (``zero2-zeroone``, ``ops.zero_one_adam``, its
``var_freeze_step`` there too, the local steps' interval doubling every
update up to 4) only the synchronisations send, that all-reduce every 4th
update: about 0.02x a step. 1-bit Adam diverges when it compresses on a
variance of one or two updates, so measure the 1-bit family after a warm-up
(``--warmup 25``), every mode alike.
Needs root and network namespaces (``ip netns``), as the tests do.

Usage: sudo python benchmarks/multinode.py [--rate 1gbit] [--steps 12] [--warmup 0] [--rounds 3]
                                          [--modes flat hsdp ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import netns  # noqa: E402
from tests.multiproc import free_port  # noqa: E402

MODES = ("flat", "hsdp", "hpz", "qwz", "hpz-qwz", "qgz", "hpz-qwz-qgz", "hpz-qwz-qgz4",
         "zero2", "zero2-onebit", "zero2-zeroone")


def mode_env(mode: str, args: argparse.Namespace) -> dict[str, str]:
    """The worker's variables for ``mode`` (see ``tests/netns_worker.py``)."""
    freeze = max(1, args.warmup - 1)  # the 1-bit family's warm-up: compressing from there
    return {"ZS_REPLICAS": "2" if mode == "hsdp" else "1",
            "ZS_RESHARD": "2" if mode.startswith("hpz") else "0",
            "ZS_QWZ": "1" if "qwz" in mode else "0",
            "ZS_QGZ": "4" if mode.endswith("qgz4") else "8" if "qgz" in mode else "0",
            "ZS_STAGE": "2" if mode.startswith("zero2") else "3",
            "ZS_ONEBIT": str(freeze) if mode.endswith("onebit") else "0",
            # 0/1 Adam's local steps from there, their interval doubling every update up to 4
            "ZS_ZEROONE": f"{freeze},1,4" if mode.endswith("zeroone") else ""}


def run(modes: list[str], args: argparse.Namespace, out: Path, tag: str) -> dict[str, dict]:
    """One torchrun launch per host that trains every mode in turn in its one
    process group (each mode's run a fresh model, step and state); each mode's
    report, its bytes read from the link's counters by the ranks."""
    env = dict(os.environ, ZS_OUT=str(out), ZS_STEPS=str(args.warmup + args.steps),
               ZS_WARMUP=str(args.warmup), PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1", ZS_D=str(args.d_model), ZS_LAYERS=str(args.layers),
               ZS_MODES=json.dumps({mode: mode_env(mode, args) for mode in modes}))
    with netns.two_hosts(rate=args.rate) as hosts:
        port, procs = free_port(), []
        for i, h in enumerate(hosts):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"{hosts[0].addr}:{port}", "--rdzv-id", f"zs-bench-{tag}", "--rdzv-conf",
                   f"is_host={int(i == 0)},join_timeout=120", "--local-addr", h.addr,
                   "--max-restarts", "0", str(ROOT / "tests" / "netns_worker.py")]
            procs.append(subprocess.Popen(h.command(cmd), cwd=ROOT, text=True,
                                          env=dict(env, GLOO_SOCKET_IFNAME=h.ifname),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for p in procs:
            log = p.communicate(timeout=900 * len(modes))[0]
            if p.returncode:
                raise SystemExit(f"{', '.join(modes)} failed:\n{log[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="the link's rate, as tc writes it")
    ap.add_argument("--steps", type=int, default=12, help="the steps measured")
    ap.add_argument("--warmup", type=int, default=0,
                    help="steps before the measured ones (0: the measured steps are the run, "
                         "its set-up's traffic included); the 1-bit family compresses from "
                         "the warm-up's last step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128, help="the GPT's width")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="the modes to run (flat is always run: the ratios are against it)")
    args = ap.parse_args()
    modes = ["flat", *[m for m in args.modes if m != "flat"]]
    why = netns.unavailable()
    if why is not None:
        raise SystemExit(f"multinode: {why}")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    sent: dict[str, list[float]] = {mode: [] for mode in modes}
    diverged: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            reports = run(modes, args, Path(tmp) / f"round{r}.json", f"round{r}")
            for mode in modes:
                report = reports[mode]
                if not all(math.isfinite(x) for x in report["losses"]):
                    diverged.add(mode)  # a run that diverged measures nothing
                times[mode].append(report["measured_seconds" if args.warmup else "seconds"]
                                   / args.steps)
                sent[mode].append(report["measured_sent"] / args.steps)
                param_bytes = report["param_bytes"]
                print(f"round {r + 1}/{args.rounds} {mode}: {times[mode][-1] * 1e3:.0f} ms/step, "
                      f"{sent[mode][-1] / 2**20:.2f} MiB sent per host and step", flush=True)
    print(f"\nGPT d={args.d_model} layers={args.layers}, {param_bytes / 2**20:.2f} MiB of params, "
          f"2 hosts x 2 processes, link {args.rate}; medians over {args.rounds} rounds of "
          f"{args.steps} steps" + (f" after {args.warmup}" if args.warmup else "") + "\n")
    print("| mode | ms/step | vs flat | MiB sent per host and step | x params' bytes |")
    print("|---|---|---|---|---|")
    flat = statistics.median(times["flat"])
    for mode in modes:
        t, b = statistics.median(times[mode]), statistics.median(sent[mode])
        print(f"| {mode}{' (diverged: its loss is not finite)' if mode in diverged else ''} "
              f"| {t * 1e3:.0f} | {t / flat:.2f} | {b / 2**20:.2f} | {b / param_bytes:.2f} |")


if __name__ == "__main__":
    main()
