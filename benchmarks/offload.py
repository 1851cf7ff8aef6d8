"""The disk tier against the in-RAM step and against the disk's own bandwidth.

    python benchmarks/offload.py                         # 200M params: RAM and disk
    python benchmarks/offload.py --params 2.2e9 --modes disk --steps 3
                                                         # state larger than RAM

An MLP of square layers (a ``shard.Layered`` JAX loss, one unit per layer) trains
with ZeRO-3 on one rank, bf16 compute and gradients, fp32 masters and Adam
moments (12 bytes per param): in RAM (``ram``), or in the disk tier
(``disk``: ``shard.Offload("disk")``). Each mode runs in its own process. The
table gives the median step, the optimizer phase (for the disk tier: streaming
the masters and moments in and out), the floor for that phase (reading and
writing the state once at the disk's measured sequential bandwidth), and the
peak RSS during the steps (initialisation excluded: the full params a caller
hands to ``init`` are the caller's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def peak_rss_reset() -> None:
    """Start a new peak-RSS window (Linux: clear_refs 5 resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def disk_bandwidth(path: Path, nbytes: int = 1 << 30) -> tuple[float, float]:
    """Sequential (write, read) bytes per second of a file under ``path``, past the
    page cache (O_DIRECT where the file system has it, else fsync'd writes and
    dropped pages)."""
    import mmap

    f = path / "bandwidth.probe"
    block = mmap.mmap(-1, 16 << 20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(1 << 20) * 16)
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct)
    except OSError:
        direct = 0
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    t0 = time.perf_counter()
    for _ in range(nbytes // len(block)):
        os.writev(fd, [block])
    os.fsync(fd)
    write = nbytes / (time.perf_counter() - t0)
    os.close(fd)
    fd = os.open(f, os.O_RDONLY | direct)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    while os.readv(fd, [block]):
        pass
    read = nbytes / (time.perf_counter() - t0)
    os.close(fd)
    f.unlink()
    return write, read


def worker(args: argparse.Namespace) -> dict:
    import jax.numpy as jnp
    import numpy as np

    import ops
    import shard

    layers, width = args.layers, args.width
    scratch = Path(args.path) / "init-params"
    scratch.mkdir(parents=True, exist_ok=True)
    params = []  # the caller's full params, memory-mapped so they need not fit in RAM
    for i in range(layers):
        w = np.memmap(scratch / f"w{i}.f32", np.float32, "w+", shape=(width, width))
        rng = np.random.default_rng(i)
        for lo in range(0, width, 512):
            w[lo:lo + 512] = rng.standard_normal((min(512, width - lo), width),
                                                 np.float32) / math.sqrt(width)
        params.append({"w": w})

    def hidden(p, h, b):
        return jnp.tanh((b if h is None else h) @ p["w"])

    def last(p, h, b):
        return jnp.mean(jnp.tanh(h @ p["w"]).astype(jnp.float32) ** 2)

    offload = (shard.Offload("disk", path=Path(args.path) / "tier", chunk_mb=args.chunk_mb)
               if args.mode == "disk" else None)
    comm = ops.spawn(lambda c: c, 1)[0]
    step = shard.zero3(shard.Layered([hidden] * (layers - 1) + [last]),
                       optimizer=ops.adamw(1e-4), comm=comm, offload=offload,
                       precision=shard.Precision(param_dtype="bf16", reduce_dtype="bf16"))
    t0 = time.perf_counter()
    state = step.init(params)
    init_s = time.perf_counter() - t0
    del params
    for f in scratch.iterdir():
        f.unlink()
    batch = np.random.default_rng(0).standard_normal((args.batch, width), np.float32)
    state, _ = step(state, batch)  # compile; first touch
    peak_rss_reset()
    steps, opt = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        steps.append(time.perf_counter() - t0)
        opt.append(m["time_ms"]["optimizer"] / 1e3)
    n = layers * width * width
    return {"mode": args.mode, "params": n, "state_gib": 12 * n / 2**30,
            "step_s": statistics.median(steps), "opt_s": statistics.median(opt),
            "init_s": init_s, "rss_mib": peak_rss_mib(), "tiers": state.tiers()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=200e6)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--modes", default="ram,disk")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--probe-mb", type=int, default=1024,
                    help="size of the disk-bandwidth probe file")
    ap.add_argument("--path", default=None, help="where the disk tier goes (default: a "
                    "temporary directory)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.layers = max(2, round(args.params / args.width**2))
    if args.worker:
        args.mode = args.worker
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    base = Path(args.path or tempfile.mkdtemp(prefix="zeroshard-offload-"))
    base.mkdir(parents=True, exist_ok=True)
    write_bw, read_bw = disk_bandwidth(base, args.probe_mb << 20)
    print(f"disk under {base}: sequential write {write_bw / 1e6:.0f} MB/s, read "
          f"{read_bw / 1e6:.0f} MB/s", flush=True)
    rows = []
    from tests.multiproc import launch  # a fresh process a mode (forked in the tests' runs)

    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--worker", mode, "--params", str(args.params),
               "--width", str(args.width), "--steps", str(args.steps), "--batch",
               str(args.batch), "--chunk-mb", str(args.chunk_mb), "--path", str(base / mode)]
        (code,), (log,) = launch(cmd, 1, {"OMP_NUM_THREADS": "1"}, timeout=3600)
        line = [x for x in log.splitlines() if x.startswith("RESULT ")]
        if code or not line:
            print(f"{mode}: failed\n{log[-3000:]}", flush=True)
            continue
        rows.append(json.loads(line[0][len("RESULT "):]))
        print(f"{mode}: done", flush=True)
    if not rows:
        return
    state_bytes = 12 * rows[0]["params"]
    floor = state_bytes / read_bw + state_bytes / write_bw
    print(f"\n{rows[0]['params'] / 1e6:,.0f}M params ({args.layers} layers of "
          f"{args.width}x{args.width}); masters + moments {rows[0]['state_gib']:.1f} GiB; "
          f"ZeRO-3, 1 rank, bf16 compute; medians of {args.steps} steps\n")
    print("| mode | step s | optimizer s | disk floor s | optimizer / floor | peak RSS MiB "
          "| RSS / state | init s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        disk = r["mode"] == "disk"
        fl = f"{floor:.2f}" if disk else "-"
        ratio = f"{r['opt_s'] / floor:.2f}" if disk else "-"
        print(f"| {r['mode']} | {r['step_s']:.2f} | {r['opt_s']:.2f} | {fl} | {ratio} | "
              f"{r['rss_mib']:,.0f} | {r['rss_mib'] * 2**20 / state_bytes:.2f} | "
              f"{r['init_s']:.1f} |")
    print("\nThe floor reads and then writes the state once at the probe's sequential rates; "
          "the tier reads and writes at once, so it can beat a floor counted serially.")


if __name__ == "__main__":
    main()
