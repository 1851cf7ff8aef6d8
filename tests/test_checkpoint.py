"""Checkpoints: exact resume at other world sizes and stages, atomicity under
SIGKILL, consolidation, and clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import ops
import shard
from shard.checkpoint import consolidate, inspect
from tests import zero_models as M

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
DATA = M.batches(10)


def _local(b, comm):
    return shard.split_batch(b, rank=comm.rank, world_size=comm.world_size)


def _make(stage, comm):
    return ZERO[stage](M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm)


def _gather_all(state, comm):
    """Full params and Adam moments (moments gathered through states over them)."""
    return (shard.gather(state, comm), shard.gather(state.replace(master=state.exp_avg), comm),
            shard.gather(state.replace(master=state.exp_avg_sq), comm))


def _straight(world, stage):
    def run(comm):
        step = _make(stage, comm)
        state = step.init(M.init_params())
        for b in DATA:
            state, _ = step(state, _local(b, comm))
        return _gather_all(state, comm)

    return ops.spawn(run, world)[0]


@pytest.fixture(scope="module")
def saved_at_step5(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "step5"

    def run(comm):
        step = _make(3, comm)
        state = step.init(M.init_params())
        for b in DATA[:5]:
            state, _ = step(state, _local(b, comm))
        shard.save(state, path, comm=comm, extra={"batch": 5, "seed": [1, 2]})

    ops.spawn(run, 4)
    return path


@pytest.mark.parametrize("world,stage", [(4, 3), (3, 3), (2, 1), (1, 3), (3, 0), (2, 2)])
def test_resume_on_other_world_sizes_and_stages(saved_at_step5, world, stage):
    want = _straight(4, 3)

    def run(comm):
        step = _make(stage, comm)
        state, extra = shard.load(saved_at_step5, step, comm=comm, like=M.init_params())
        assert extra == {"batch": 5, "seed": [1, 2]} and int(state.step) == 5
        for b in DATA[5:]:
            state, _ = step(state, _local(b, comm))
        return _gather_all(state, comm)

    got = ops.spawn(run, world)[0]
    exact = world == 4 and stage == 3  # the same reduction order: bit for bit
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            # another world size sums gradients in another order: 1e-6 relative to
            # each tensor's scale (moments near zero cancel)
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())


KILLER = r"""
import os, signal, sys
sys.path.insert(0, {root!r})
import ops, shard
from shard.checkpoint import _checkpoint
from tests import zero_models as M
path = {path!r}
def run(comm):
    step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    state = step.init(M.init_params())
    state, _ = step(state, shard.split_batch(M.batches(1)[0], rank=comm.rank,
                                             world_size=comm.world_size))
    shard.save(state, path, comm=comm, extra={{"which": "first"}})
    real = _checkpoint._write_rank_file
    def die_midway(state, p):
        out = real(state, p)
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank file is on disk, then the job dies
        return out
    _checkpoint._write_rank_file = die_midway
    state, _ = step(state, shard.split_batch(M.batches(2)[1], rank=comm.rank,
                                             world_size=comm.world_size))
    shard.save(state, path, comm=comm, extra={{"which": "second"}})
ops.spawn(run, 2)
"""


@pytest.mark.multiprocess
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    from tests.multiproc import ROOT

    path = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT), path=str(path))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert path.with_name("ckpt.tmp").exists()  # the interrupted save

    def run(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state, extra = shard.load(path, step, comm=comm, like=M.init_params())
        state, _ = step(state, _local(DATA[0], comm))  # and training goes on
        return extra, int(state.step)

    assert ops.spawn(run, 3) == [({"which": "first"}, 2)] * 3


@pytest.mark.multiprocess
def test_consolidated_file_loads_into_numpy_and_torch(saved_at_step5, tmp_path):
    out = tmp_path / "full.safetensors"
    names = consolidate(saved_at_step5, out, optimizer=True)
    assert names["0.w"] == (7, 5) and names["0.w.exp_avg"] == (7, 5)
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as torch_load

    arrays = load_file(str(out))

    def run(comm):
        state, _ = shard.load(saved_at_step5, _make(3, comm), comm=comm, like=M.init_params())
        return shard.gather(state, comm)

    full = ops.spawn(run, 2)[0]
    np.testing.assert_array_equal(arrays["1.b"], full[1]["b"])
    np.testing.assert_array_equal(torch_load(str(out))["0.w"].numpy(), full[0]["w"])
    text = inspect(saved_at_step5)
    assert "step 5, stage 3, 4 rank layout" in text and "'batch': 5" in text
    cli = subprocess.run([sys.executable, "-m", "shard.checkpoint", "inspect",
                          str(saved_at_step5)], capture_output=True, text=True)
    assert cli.returncode == 0 and "0.w" in cli.stdout


def test_orbax_reads_the_params_and_moments_a_checkpoint_holds(saved_at_step5, tmp_path):
    """``to_orbax`` (and ``python -m shard.checkpoint orbax``) write the full
    params, the step and the moments as an orbax checkpoint, in the params'
    own structure, which orbax's StandardCheckpointer restores as they are."""
    ocp = pytest.importorskip("orbax.checkpoint")
    written = shard.checkpoint.to_orbax(saved_at_step5, tmp_path / "orbax", optimizer=True)
    assert written["params"][0]["w"].shape == (7, 5)
    got = ocp.StandardCheckpointer().restore((tmp_path / "orbax").absolute())

    def run(comm):
        state, _ = shard.load(saved_at_step5, _make(3, comm), comm=comm, like=M.init_params())
        return _gather_all(state, comm)

    full, exp_avg, exp_avg_sq = ops.spawn(run, 2)[0]
    assert int(got["step"]) == 5 and isinstance(got["params"], list)
    for have, want in [(got["params"], full), (got["opt"]["exp_avg"], exp_avg),
                       (got["opt"]["exp_avg_sq"], exp_avg_sq)]:
        assert jax.tree_util.tree_structure(have) == jax.tree_util.tree_structure(want)
        for a, b in zip(jax.tree_util.tree_leaves(have), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(shard.CheckpointError, match="exists"):
        shard.checkpoint.to_orbax(saved_at_step5, tmp_path / "orbax")
    code, text = shard.checkpoint.run(["orbax", str(saved_at_step5), str(tmp_path / "cli")])
    assert code == 0 and "6 arrays" in text  # 5 params and the step
    again = ocp.StandardCheckpointer().restore((tmp_path / "cli").absolute())
    assert "opt" not in again
    np.testing.assert_array_equal(np.asarray(again["params"][1]["gain"]), full[1]["gain"])


def _load_error(path):
    def run(comm):
        shard.load(path, _make(3, comm), comm=comm, like=M.init_params())

    with pytest.raises(shard.CheckpointError) as info:
        ops.spawn(run, 2)
    return str(info.value)


def test_bad_checkpoints_raise_naming_the_file(saved_at_step5, tmp_path):
    missing = shutil.copytree(saved_at_step5, tmp_path / "missing")
    (missing / "rank-00001.safetensors").unlink()
    assert "rank-00001.safetensors: missing shard file" in _load_error(missing)

    truncated = shutil.copytree(saved_at_step5, tmp_path / "truncated")
    f = truncated / "rank-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    assert "rank-00002.safetensors: truncated" in _load_error(truncated)

    corrupt = shutil.copytree(saved_at_step5, tmp_path / "corrupt")
    f = corrupt / "rank-00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    assert "rank-00000.safetensors: checksum mismatch" in _load_error(corrupt)

    newer = shutil.copytree(saved_at_step5, tmp_path / "newer")
    m = json.loads((newer / "manifest.json").read_text())
    m["version"] = 99
    (newer / "manifest.json").write_text(json.dumps(m))
    assert "format version 99 is newer" in _load_error(newer)

    def wrong_model(comm):
        params = M.init_params()
        params[0]["w"] = np.zeros((8, 5), np.float32)
        shard.load(saved_at_step5, _make(3, comm), comm=comm, like=params)

    with pytest.raises(shard.CheckpointError, match=r"has shape \(7, 5\) in the checkpoint but "
                                                    r"\(8, 5\) in the model"):
        ops.spawn(wrong_model, 2)


@pytest.mark.multiprocess
def test_consolidated_gpt_checkpoint_gives_the_sharded_loss(tmp_path):
    """Train the torch GPT example with ZeRO-3, save, consolidate, load into a
    plain torch model: the same loss as the sharded state's."""
    import copy

    import torch

    import interop.torch as it
    from examples import gpt

    cfg = gpt.GPTConfig(seq=16, d=32, layers=2, heads=2)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    text = gpt.corpus()
    probe = gpt.sample_batch(text, 999, 8, cfg.seq)
    path = tmp_path / "gpt"

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=gpt.lm_loss)
        step = shard.zero3(fn, optimizer=ops.adamw(3e-3), comm=comm)
        state = step.init(params)
        for i in range(5):
            state, _ = step(state, gpt.local_part(gpt.sample_batch(text, i, 8, cfg.seq), comm))
        shard.save(state, path, comm=comm)
        full = shard.gather(state, comm)
        return float(fn.value_and_grad(full, probe)[0])

    sharded_loss = ops.spawn(run, 2)[0]
    out = tmp_path / "gpt.safetensors"
    subprocess.run([sys.executable, "-m", "shard.checkpoint", "consolidate", str(path),
                    str(out)], check=True, capture_output=True)
    from safetensors.torch import load_file

    plain = gpt.GPT(cfg)
    plain.load_state_dict(load_file(str(out)), strict=True)  # head.weight, tied, included
    assert torch.equal(plain.head.weight, plain.tok_emb.weight)
    with torch.no_grad():
        assert float(gpt.lm_loss(plain, probe)) == pytest.approx(sharded_loss, rel=1e-6)


FIXTURE = Path(__file__).parent / "data" / "checkpoint-2026-11-23"


@pytest.mark.parametrize("world,stage", [(4, 3), (3, 2)])
def test_a_checkpoint_an_earlier_commit_wrote_still_resumes(world, stage):
    """``tests/data/make_checkpoint_fixture.py`` wrote these files on 2026-11-23
    (``saved_at_step5``'s run, and its params and moments after 10 steps): they
    load, and the run resumed from them ends where the unbroken run ended, to
    the last bit or two: XLA's CPU kernels round the loss's matmuls differently
    on another vector instruction set (the fixture's machine had AVX-512), so
    the bit-for-bit resume is :func:`test_resume_on_other_world_sizes_and_stages`'s,
    on one machine."""
    want = list(np.load(FIXTURE / "expected.npz").values())

    def run(comm):
        step = _make(stage, comm)
        state, extra = shard.load(FIXTURE / "step5", step, comm=comm, like=M.init_params())
        assert extra == {"batch": 5, "seed": [1, 2]} and int(state.step) == 5
        for b in DATA[5:]:
            state, _ = step(state, _local(b, comm))
        return _gather_all(state, comm)

    got = jax.tree_util.tree_leaves(ops.spawn(run, world)[0])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())
