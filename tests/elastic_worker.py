"""One rank of the elastic-recovery test: ``examples/gpt.py``'s GPT trained with
ZeRO-3 under ``torchrun --max-restarts 1``, a checkpoint every ZS_EVERY steps
(with the data position), resuming from the latest one when it exists. On the
first attempt, rank ZS_KILL_RANK SIGKILLs itself before step ZS_KILL_STEP
(ZS_KILL_STEP < 0: never). Rank 0 of the attempt that finishes writes the
trained params' checksums and the steps it ran to ZS_OUT. With ZS_ASYNC=1 the
checkpoints are ``shard.async_save``'s, and on the first attempt each rank
file after the first checkpoint's takes ZS_SLOW_DISK more seconds to write (a
slow disk). While the file ZS_PAUSE names exists, each step after the first
checkpoint takes a second longer (the multi-node test kills a host meanwhile).
:func:`uninterrupted` is the run never interrupted, on thread ranks: the
tests' reference."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

CFG = {"seq": 16, "d": 32, "layers": 2, "heads": 2}


def build(comm, model=None):
    """(the ZeRO-3 step, its initial state, a batch function): ``examples/gpt.py``'s
    GPT, ``model`` (built here if None) as this rank's copy."""
    import interop.torch as it
    import ops
    import shard
    from examples import gpt

    cfg = gpt.GPTConfig(**CFG)
    params, loss = it.functional(model if model is not None else gpt.build(cfg),
                                 loss=gpt.lm_loss)
    step = shard.zero3(loss, optimizer=ops.adamw(3e-3, weight_decay=0.01), comm=comm,
                       clip_norm=1.0)
    data = gpt.corpus()
    return step, step.init(params), lambda i: gpt.local_part(
        gpt.sample_batch(data, i, 8, cfg.seq), comm)


def checksums(whole: dict) -> dict[str, str]:
    return {k: v.tobytes().hex() for k, v in whole.items()}


def uninterrupted(world: int, steps: int) -> dict[str, str]:
    """The params' bytes after ``steps`` steps of ``world`` thread ranks, never
    interrupted: those of ``world`` gloo processes under torchrun too (2 and 4
    matched byte for byte), so the restarted runs are compared with them."""
    import copy

    import ops
    import shard
    from examples import gpt

    model = gpt.build(gpt.GPTConfig(**CFG))

    def run(comm):
        step, state, batch = build(comm, copy.deepcopy(model))
        for i in range(steps):
            state, _ = step(state, batch(i))
        return checksums(shard.gather(state, comm))

    return ops.spawn(run, world)[0]


def main() -> None:
    import numpy as np

    import ops
    import shard

    comm = ops.init_from_env()
    steps, every = int(os.environ["ZS_STEPS"]), int(os.environ["ZS_EVERY"])
    kill_rank, kill_step = int(os.environ["ZS_KILL_RANK"]), int(os.environ["ZS_KILL_STEP"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = Path(os.environ["ZS_CKPT"])
    step, state, batch_at = build(comm)
    first = 0
    if (ckpt / "manifest.json").exists():
        state, extra = shard.load(ckpt, step, comm=comm)
        first = int(extra["next_batch"])
    asynchronous = os.environ.get("ZS_ASYNC") == "1"
    if asynchronous and attempt == 0:
        from shard.checkpoint import _checkpoint

        real, delay = _checkpoint.write_tensors, float(os.environ.get("ZS_SLOW_DISK", "0"))

        def slow_disk(tensors, path):
            out = real(tensors, path)
            if slow:
                time.sleep(delay)
            return out

        _checkpoint.write_tensors = slow_disk
    ran, pending, slow = [], None, False
    for i in range(first, steps):
        if attempt == 0 and comm.rank == kill_rank and i == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if i >= every and os.environ.get("ZS_PAUSE") and Path(os.environ["ZS_PAUSE"]).exists():
            time.sleep(1.0)
        state, _ = step(state, batch_at(i))
        ran.append(i)
        if (i + 1) % every == 0 and asynchronous:
            pending = shard.async_save(state, ckpt, comm=comm, extra={"next_batch": i + 1})
            if not slow:  # the first checkpoint is written before the disk turns slow
                pending.wait()
            slow = True
        elif (i + 1) % every == 0:
            shard.save(state, ckpt, comm=comm, extra={"next_batch": i + 1})
    if pending is not None:
        pending.wait()
    whole = shard.gather(state, comm)
    if comm.rank == 0:
        Path(os.environ["ZS_OUT"]).write_text(json.dumps({
            "attempt": attempt, "first": first, "ran": ran,
            "params": checksums(whole),
            "sum": float(sum(np.abs(v).sum(dtype=np.float64) for v in whole.values()))}))
    comm.barrier()


if __name__ == "__main__":
    main()
