"""Planted faults: each is a one-line bug a refactor could bring, and the suite
must fail with it. ``make faults`` (``python tests/planted_faults.py``) copies
the working tree once per fault, plants the fault in the copy, and runs the
fast tier of the tests that cover that code there; a fault that passes them
is reported, and the command fails. The same tests run first on an unchanged
copy, which must pass, so a failure is the fault's and not the copy's.

Not collected by pytest (its name does not start with ``test_``); importing
it does nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = "not multiprocess and not netns and not notebook and not slow"


@dataclass(frozen=True)
class Fault:
    name: str
    path: str  # relative to the repository
    old: str  # occurs exactly once in the file
    new: str
    tests: tuple[str, ...]


FAULTS = [
    Fault("a wrong sign in the reduce (the threads communicator's sums)",
          "ops/comm/_thread_runs.py",
          "        for xr in xs[1:]:\n"
          "            xp.add(acc, xr.reshape(-1)[lo:hi], out=acc)\n",
          "        for xr in xs[1:]:\n"
          "            xp.subtract(acc, xr.reshape(-1)[lo:hi], out=acc)\n",
          ("tests/test_zero.py",)),
    Fault("a skipped gather (stage 3's unit gather)",
          "shard/step/_runtime.py",
          "            work = self.comm.all_gather_async(out, shard[:unit.sharded_size])\n",
          "            work = None\n",
          ("tests/test_zero.py",)),
    Fault("an off-by-one in the checkpoint slicer (a rank's rows on load)",
          "shard/checkpoint/_load.py",
          "    return lo, min(lo + leaf.rows_per_rank, leaf.rows)\n",
          "    return lo, min(lo + leaf.rows_per_rank - 1, leaf.rows)\n",
          ("tests/test_checkpoint.py",)),
    Fault("a swapped pipeline message (a stage pairs micro-batch k's activations with "
          "k + 1's rows)",
          "shard/pipelines/_pipeline.py",
          "            if kind == \"F\":\n"
          "                out = runner.forward(k, None if first else self._recv(self.stage - 1),"
          " micro[k])\n",
          "            if kind == \"F\":\n"
          "                out = runner.forward(k, None if first else self._recv(self.stage - 1),"
          " micro[k if first else (k + 1) % m])\n",
          ("tests/test_pipeline.py",)),
    Fault("an np.asarray on device state (the gradients' norm)",
          "shard/step/_update.py",
          "    for unit, g in zip(layout.units, shards, strict=True):\n        cuts = ",
          "    for unit, g in zip(layout.units, shards, strict=True):\n        np.asarray(g)\n"
          "        cuts = ",
          ("tests/test_device.py",)),
]


def copy_tree(dst: Path) -> None:
    """The tracked and untracked (not ignored) files of the working tree."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, str, float]:
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-m", FAST, *tests], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    return done.returncode, (failed[0] if failed else done.stdout.strip().splitlines()[-1]), \
        time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", type=int, nargs="*", help="fault numbers (from 1)")
    args = p.parse_args(argv)
    chosen = [(i, f) for i, f in enumerate(FAULTS, 1) if not args.only or i in args.only]
    escaped = []
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        base = Path(tmp) / "tree"
        copy_tree(base)
        tests = tuple(sorted({t for _, f in chosen for t in f.tests}))
        rc, last, s = run_tests(base, tests)
        print(f"unchanged copy: {' '.join(tests)}: {last} ({s:.0f} s)", flush=True)
        if rc:
            print("the unchanged copy fails its tests: no fault can be judged", file=sys.stderr)
            return 2
        for i, fault in chosen:
            tree = Path(tmp) / f"fault-{i}"
            shutil.copytree(base, tree)
            target = tree / fault.path
            text = target.read_text()
            if text.count(fault.old) != 1:
                print(f"{i}. {fault.name}: its line is not in {fault.path} once; update "
                      "tests/planted_faults.py", file=sys.stderr)
                return 2
            target.write_text(text.replace(fault.old, fault.new))
            rc, last, s = run_tests(tree, fault.tests)
            caught = rc != 0
            print(f"{i}. {fault.name}: {'caught' if caught else 'NOT CAUGHT'} by "
                  f"{' '.join(fault.tests)} ({s:.0f} s): {last}", flush=True)
            if not caught:
                escaped.append(fault.name)
            shutil.rmtree(tree)
    if escaped:
        print(f"{len(escaped)} planted fault(s) passed the tests: {escaped}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
