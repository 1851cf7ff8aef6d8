"""Collective bandwidth: ours against raw torch.distributed, side by side.

gloo (run under torchrun, one process per rank):
    torchrun --nproc-per-node 2 benchmarks/collectives.py gloo
threads (one process, ranks as threads; compared with memcpy bandwidth):
    python benchmarks/collectives.py threads --world 2
the fixed-tree sums of invariant_shards= against the ring ones, on gloo:
    torchrun --nproc-per-node 4 benchmarks/collectives.py ordered

Sizes are the whole buffer (the gathered output, the reduce-scatter input), as
nccl-tests count them; bus bandwidth = size / time * (W - 1) / W, the bytes each
rank must move. Each cell is the median over iterations, timed on rank 0
between barriers. Rows for gloo:
  raw          torch.distributed all_gather_single / reduce_scatter_single
  ours         ops.GlooCommunicator as shipped (argument check included)
  ours nocheck the same with check=False
  pairwise     ours forced to the isend/irecv algorithm at every size
  builtin      ours forced to gloo's built-ins at every size
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import ops
from ops.comm._gloo import _single

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def iters_for(nbytes: int) -> int:
    return max(5, min(200, (64 << 20) // max(nbytes, 1)))


def fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def timed(fn, barrier, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gloo_main() -> None:
    import torch
    import torch.distributed as dist

    from ops.comm._gloo import GlooCommunicator

    comm = ops.init_from_env()
    w, rank = comm.world_size, comm.rank
    variants = {
        "ours": comm,
        "ours nocheck": GlooCommunicator(check=False),
        "pairwise": GlooCommunicator(check=False, small_bytes=0),
        "builtin": GlooCommunicator(check=False, small_bytes=1 << 62),
    }
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4
        full = np.ones(n, np.float32)
        chunk = np.ones(n // w, np.float32)
        tf, tc = torch.from_numpy(full), torch.from_numpy(chunk)
        it = iters_for(nbytes)
        res = {
            ("all_gather", "raw"): timed(
                lambda tf=tf, tc=tc: _single(dist, "all_gather")(tf, tc), dist.barrier, it),
            ("reduce_scatter", "raw"): timed(
                lambda tf=tf, tc=tc: _single(dist, "reduce_scatter")(tc, tf), dist.barrier, it),
        }
        for name, c in variants.items():
            res[("all_gather", name)] = timed(
                lambda c=c, f=full, x=chunk: c.all_gather_into(f, x), dist.barrier, it)
            res[("reduce_scatter", name)] = timed(
                lambda c=c, f=full, x=chunk: c.reduce_scatter_into(x, f), dist.barrier, it)
        rows.append((nbytes, res))
        if rank == 0:
            print(f"  {fmt(nbytes)} done", flush=True)
    if rank == 0:
        print(f"\ngloo, {w} processes, torch {torch.__version__}; bus GB/s (ratio to raw)\n")
        names = ["raw", *variants]
        for coll in ("all_gather", "reduce_scatter"):
            print(f"| {coll} | " + " | ".join(names) + " |")
            print("|---" * (len(names) + 1) + "|")
            for nbytes, res in rows:
                raw = res[(coll, "raw")]
                cells = []
                for name in names:
                    t = res[(coll, name)]
                    bw = nbytes / t * (w - 1) / w / 1e9
                    cells.append(f"{bw:.2f}" + ("" if name == "raw" else f" ({raw / t:.2f}x)"))
                print(f"| {fmt(nbytes)} | " + " | ".join(cells) + " |")
            print()
    comm.barrier()


def ordered_main() -> None:
    """The ordered collectives of [Note: ordered sums] (ops/comm/_ordered.py)
    against the communicator's own: time, and the bytes each rank sends,
    counted at its sends, against their formulas."""
    import torch.distributed as dist

    from ops.comm._ordered import tree_all_reduce, tree_reduce_scatter

    comm = ops.init_from_env()
    w, rank = comm.world_size, comm.rank
    sent = [0]
    isend = comm.isend

    def counted(x, dst, *, tag=0):
        sent[0] += x.nbytes
        return isend(x, dst, tag=tag)

    comm.isend = counted  # type: ignore[method-assign]
    rows = []
    for nbytes in SIZES[:7]:
        n = nbytes // 4
        full, chunk = np.zeros(n, np.float32), np.zeros(n // w, np.float32)
        it = max(5, iters_for(nbytes) // 4)
        ring_rs = timed(lambda f=full, x=chunk: comm.reduce_scatter_into(x, f), dist.barrier, it)
        ring_ar = timed(lambda f=full: comm.all_reduce_(f), dist.barrier, it)
        sent[0] = 0
        tree_rs = timed(lambda f=full, x=chunk: tree_reduce_scatter(comm, x, f.copy()),
                        dist.barrier, it)
        rs_bytes, sent[0] = sent[0] / (it + 1), 0
        tree_ar = timed(lambda f=full: tree_all_reduce(comm, f), dist.barrier, it)
        ar_bytes = sent[0] / (it + 1)
        rows.append((nbytes, ring_rs, tree_rs, rs_bytes, ring_ar, tree_ar, ar_bytes))
    if rank == 0:
        log = w.bit_length() - 1
        print(f"\ngloo, {w} processes: ring (ours) against the fixed tree; ms (tree/ring), and "
              f"MiB each rank sends: the tree's counted, each formula's\n")
        print("| size | reduce-scatter ring | tree | sent: tree, ring (W-1)/W n | all-reduce ring "
              f"| tree | sent: tree (log2 W = {log}) n, ring 2(W-1)/W n |")
        print("|---|---|---|---|---|---|---|")
        mib = 1 << 20
        for nbytes, rr, tr, rb, ra, ta, ab in rows:
            print(f"| {fmt(nbytes)} | {rr * 1e3:.2f} | {tr * 1e3:.2f} ({tr / rr:.2f}x) "
                  f"| {rb / mib:.2f}, {nbytes * (w - 1) / w / mib:.2f} | {ra * 1e3:.2f} "
                  f"| {ta * 1e3:.2f} ({ta / ra:.2f}x) | {ab / mib:.2f} = {log * nbytes / mib:.2f}, "
                  f"{2 * nbytes * (w - 1) / w / mib:.2f} |")
    comm.barrier()


def threads_main(world: int) -> None:
    def body(comm):
        out = {}
        for nbytes in SIZES:
            n = nbytes // 4
            full, chunk = comm.allocate(n, np.float32), comm.allocate(n // world, np.float32)
            full[...] = 1
            chunk[...] = 1
            it = iters_for(nbytes)
            out[nbytes] = (
                timed(lambda f=full, x=chunk: comm.all_gather_into(f, x), comm.barrier, it),
                timed(lambda f=full, x=chunk: comm.reduce_scatter_into(x, f), comm.barrier, it))
        return out

    res = ops.spawn(body, world)[0]
    print(f"\nthreads, world {world}; bus GB/s and fraction of memcpy bandwidth\n")
    print("| size | memcpy GB/s | all_gather | reduce_scatter |")
    print("|---|---|---|---|")
    for nbytes in SIZES:
        a, b = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        t_copy = timed(lambda a=a, b=b: np.copyto(b, a), lambda: None, iters_for(nbytes))
        copy_bw = nbytes / t_copy / 1e9
        ag, rs = (nbytes / t * (world - 1) / world / 1e9 for t in res[nbytes])
        print(f"| {fmt(nbytes)} | {copy_bw:.1f} | {ag:.1f} ({ag / copy_bw:.2f}) | "
              f"{rs:.1f} ({rs / copy_bw:.2f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend", choices=["gloo", "threads", "ordered"])
    ap.add_argument("--world", type=int, default=2, help="threads backend: number of ranks")
    args = ap.parse_args()
    if args.backend in ("gloo", "ordered"):
        if "RANK" not in os.environ:
            raise SystemExit("run the gloo benchmarks under torchrun: torchrun "
                             f"--nproc-per-node 2 benchmarks/collectives.py {args.backend}")
        gloo_main() if args.backend == "gloo" else ordered_main()
    else:
        threads_main(args.world)


if __name__ == "__main__":
    main()
