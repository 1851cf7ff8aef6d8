"""Asynchronous checkpoints (``shard.async_save``, [Note: asynchronous saves]):
the files are ``shard.save``'s, byte for byte, for the state of the call while
the next steps run; a process killed during the write keeps the previous
checkpoint, and training resumes from it; a rank that cannot write fails the
save on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import ops
import shard
from shard.checkpoint import _checkpoint as ck
from tests import zero_models as M

DATA = M.batches(6)


def _local(batch, comm):
    return shard.split_batch(batch, rank=comm.rank, world_size=comm.world_size)


def _slow_writes(monkeypatch, seconds):
    real = ck.write_tensors

    def slow(tensors, path):
        out = real(tensors, path)
        time.sleep(seconds)  # a slow disk: the file is written, the receipt not yet
        return out

    monkeypatch.setattr(ck, "write_tensors", slow)


def test_async_save_writes_the_state_of_its_call_while_the_next_steps_run(tmp_path,
                                                                          monkeypatch):
    _slow_writes(monkeypatch, 0.5)
    sync, later = tmp_path / "sync", tmp_path / "async"

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        for b in DATA[:2]:
            state, _ = step(state, _local(b, comm))
        shard.save(state, sync, comm=comm, extra={"next": 2})
        pending = shard.async_save(state, later, comm=comm, extra={"next": 2})
        for b in DATA[2:4]:  # these change the state the save copied
            state, _ = step(state, _local(b, comm))
        ran_during = not pending.done()
        assert pending.wait() == later and pending.done()
        return ran_during

    assert all(ops.spawn(run, 3))
    assert json.loads((sync / "manifest.json").read_text()) == \
        json.loads((later / "manifest.json").read_text())
    for f in sorted(sync.iterdir()):
        assert f.read_bytes() == (later / f.name).read_bytes(), f.name
    assert sorted(p.name for p in later.iterdir()) == sorted(p.name for p in sync.iterdir())
    assert not later.with_name("async.tmp").exists()

    def resume(comm):  # and it loads at another world size, the run going on
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state, extra = shard.load(later, step, comm=comm, like=M.init_params())
        for b in DATA[extra["next"]:]:
            state, _ = step(state, _local(b, comm))
        return shard.gather(state, comm)

    def straight(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        for b in DATA:
            state, _ = step(state, _local(b, comm))
        return shard.gather(state, comm)

    got, want = ops.spawn(resume, 2)[0], ops.spawn(straight, 2)[0]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


KILLER = r"""
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import ops, shard
from shard.checkpoint import _checkpoint as ck
from tests import zero_models as M
path = Path({path!r})
real = ck.write_tensors
def slow_disk(tensors, p):
    out = real(tensors, p)
    time.sleep(60)
    return out
def run(comm):
    step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    state = step.init(M.init_params())
    data = M.batches(4)
    state, _ = step(state, shard.split_batch(data[0], rank=comm.rank, world_size=2))
    shard.save(state, path, comm=comm, extra={{"which": "first"}})
    ck.write_tensors = slow_disk
    state, _ = step(state, shard.split_batch(data[1], rank=comm.rank, world_size=2))
    pending = shard.async_save(state, path, comm=comm, extra={{"which": "second"}})
    for b in data[2:]:  # training goes on while the files are written
        state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=2))
    comm.barrier()
    if comm.rank == 1:
        time.sleep(60)
    tmp = path.with_name("ckpt.tmp")
    while not (tmp / "rank-00001.safetensors").exists():
        time.sleep(0.01)
    print("steps ran:", int(state.step), "done:", pending.done(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-write: files on disk, no manifest yet
ops.spawn(run, 2)
"""


@pytest.mark.multiprocess
def test_sigkill_during_an_async_write_keeps_the_previous_checkpoint(tmp_path):
    from tests.multiproc import ROOT

    path = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT), path=str(path))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "steps ran: 4 done: False" in proc.stdout  # two steps after the async_save
    tmp = path.with_name("ckpt.tmp")
    assert (tmp / "rank-00001.safetensors").exists() and not (tmp / "manifest.json").exists()

    def run(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state, extra = shard.load(path, step, comm=comm, like=M.init_params())
        state, _ = step(state, _local(DATA[0], comm))  # and training goes on
        shard.async_save(state, path, comm=comm, extra={"which": "third"}).wait()
        return extra, int(state.step)

    assert ops.spawn(run, 3) == [({"which": "first"}, 2)] * 3
    assert not tmp.exists()  # the next save replaced the interrupted one


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path, monkeypatch):
    real = ck.write_tensors

    def full_disk(tensors, path):
        if path.name == "rank-00001.safetensors":
            raise OSError(28, "No space left on device")
        return real(tensors, path)

    path = tmp_path / "ckpt"

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        shard.save(state, path, comm=comm, extra={"which": "first"})
        if comm.rank == 0:
            monkeypatch.setattr(ck, "write_tensors", full_disk)
        comm.barrier()
        pending = shard.async_save(state, path, comm=comm, extra={"which": "second"})
        with pytest.raises((shard.CheckpointError, OSError)) as e:
            pending.wait()
        comm.barrier()
        if comm.rank == 0:
            monkeypatch.setattr(ck, "write_tensors", real)
        comm.barrier()
        _, extra = shard.load(path, step, comm=comm, like=M.init_params())
        shard.async_save(state, path, comm=comm, extra={"which": "third"}).wait()  # goes on
        return str(e.value), extra

    out = ops.spawn(run, 3)
    assert json.loads((path / "manifest.json").read_text())["extra"] == {"which": "third"}
    assert "No space left on device" in out[1][0]
    for msg, extra in (out[0], out[2]):
        assert "ranks [1] could not write" in msg or "rank 0 could not complete" in msg, msg
        assert "No space left" in msg and extra == {"which": "first"}


def test_save_after_async_save_waits_for_it_and_disk_tiers_are_refused(tmp_path):
    path = tmp_path / "ckpt"

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        shard.async_save(state, path, comm=comm, extra={"which": "async"})
        state, _ = step(state, _local(DATA[0], comm))
        shard.save(state, path, comm=comm, extra={"which": "sync"})  # waits, then replaces
        _, extra = shard.load(path, step, comm=comm, like=M.init_params())
        disk = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm,
                           offload=shard.Offload("disk", path=tmp_path / f"tier{comm.rank}"))
        with pytest.raises(TypeError, match="async_save: the disk tier"):
            shard.async_save(disk.init(M.init_params()), tmp_path / "d", comm=comm)
        with pytest.raises(TypeError, match="async_save: extra must be JSON"):
            shard.async_save(state, tmp_path / "e", comm=comm, extra={"a": np.zeros(2)})
        return extra

    assert ops.spawn(run, 2) == [{"which": "sync"}] * 2


def test_a_rank_that_sees_the_async_commit_late_is_waited_for_by_the_next_save(
        tmp_path, monkeypatch):
    """Rank 1 looks for rank 0's commit of an async_save only after rank 0 has
    committed it and gone on to a save of the same path: that save's fresh
    <path>.tmp must not be taken for the old one's (rank 1 would wait for it)."""
    from shard.checkpoint import _async

    real = _async._await_commit

    def late(path, tmp, timeout):
        if not (tmp.parent / "looked").exists():
            time.sleep(0.5)
        (tmp.parent / "looked").touch()
        return real(path, tmp, timeout)

    monkeypatch.setattr(_async, "_await_commit", late)
    path = tmp_path / "ckpt"

    def run(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        shard.async_save(state, path, comm=comm, extra={"which": "async"}, timeout=3.0)
        shard.save(state, path, comm=comm, extra={"which": "sync"})
        return shard.load(path, step, comm=comm)[1]

    assert ops.spawn(run, 2) == [{"which": "sync"}] * 2
