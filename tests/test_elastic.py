"""Elastic recovery: under ``torchrun --max-restarts 1``, a rank SIGKILLed in the
middle of a run is restarted with its peers, they resume from the latest
checkpoint with the data stream where it stopped, and the run ends with params
bit-identical to one that was never interrupted."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests.multiproc import ROOT

STEPS, EVERY = 9, 3


def run(tmp, name, kill_rank, kill_step, **more):
    out = tmp / f"{name}.json"
    # a fresh store per rendezvous round: see init_from_env's warning (pytorch#135712)
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               ZS_OUT=str(out), ZS_CKPT=str(tmp / f"{name}-ckpt"),
               ZS_STEPS=str(STEPS), ZS_EVERY=str(EVERY), ZS_KILL_RANK=str(kill_rank),
               ZS_KILL_STEP=str(kill_step), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **more)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(ROOT / "tests" / "elastic_worker.py")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def straight():
    """The params of the run never interrupted (on thread ranks: the same bits
    as the two processes)."""
    from tests.elastic_worker import uninterrupted

    return uninterrupted(2, STEPS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("seed", [1])  # rank 0 killed before step 8 (seed 0: rank 1, step 7)
def test_a_rank_killed_mid_run_restarts_and_ends_bit_identical(tmp_path, straight, seed):
    rng = random.Random(seed)
    kill_rank, kill_step = rng.randrange(2), rng.randrange(EVERY + 1, STEPS)
    killed, log = run(tmp_path, "killed", kill_rank, kill_step)
    assert killed["attempt"] == 1, log[-3000:]  # the restarted attempt finished
    resumed_at = kill_step // EVERY * EVERY  # the latest checkpoint before the kill
    assert killed["first"] == resumed_at and killed["ran"] == list(range(resumed_at, STEPS))
    assert killed["params"] == straight  # bit for bit


@pytest.mark.multiprocess
def test_a_rank_killed_during_an_async_save_resumes_from_the_one_before(tmp_path, straight):
    """Asynchronous saves on a slow disk: the rank killed one step after the
    save of step 6 began takes the job down while that save's files are being
    written; the restarted job finds the save of step 3, the last complete
    one, and ends bit-identical to the uninterrupted run."""
    killed, log = run(tmp_path, "killed-async", 1, 2 * EVERY + 1, ZS_ASYNC="1",
                      ZS_SLOW_DISK="20")
    assert killed["attempt"] == 1, log[-3000:]
    assert killed["first"] == EVERY and killed["ran"] == list(range(EVERY, STEPS))
    assert killed["params"] == straight  # bit for bit
