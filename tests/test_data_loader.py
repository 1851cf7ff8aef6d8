"""shard.DataLoader: each data rank's part of every global batch, in an order
fixed by the seed and the epoch, resumed from a checkpoint at any world size
(see [Note: the data order])."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
import torch

import ops
import shard
from tests import zero_models as M

N, G = 50, 12  # 50 rows, global batches of 12: 4 a epoch, 2 rows left out of each


def rows_seen(world, *, micro=1, epochs=2, shape=None):
    """Every rank's rows per position over ``epochs`` epochs: {position: [per
    rank: [per micro-batch: row ids]]}, and the data ranks' count."""
    data = {"id": np.arange(N), "x": np.arange(N * 2.0).reshape(N, 2)}

    def run(comm):
        kw = {"mesh": shard.Mesh(comm, shape)} if shape else {"comm": comm}
        loader = shard.DataLoader(data, G, gradient_accumulation_steps=micro, seed=3, **kw)
        out = []
        for _ in range(epochs):
            for batch in loader:
                parts = list(batch) if micro > 1 else [batch]
                for part in parts:  # the rows and the arrays agree
                    np.testing.assert_array_equal(part["x"][:, 0], 2.0 * part["id"])
                out.append([part["id"].tolist() for part in parts])
        return out, loader.rank, loader.ranks

    return ops.spawn(run, world)


@pytest.mark.parametrize("world,micro,shape", [
    (1, 1, None), (2, 1, None), (3, 2, None), (4, 1, None), (2, 3, None),
    (4, 1, {"replicate": 2, "shard": 2}),
    (8, 2, {"pipe": 2, "data": 2, "model": 2}),
    (4, 1, {"data": 1, "model": 4}),
])
def test_ranks_rows_are_disjoint_cover_each_epoch_and_do_not_depend_on_the_world(
        world, micro, shape):
    seen = rows_seen(world, micro=micro, shape=shape)
    by_data_rank = {}
    for out, rank, _ in seen:  # model and pipe ranks of a data rank see the same rows
        assert by_data_rank.setdefault(rank, out) == out
    ranks = len(by_data_rank)
    reference = rows_seen(1, micro=micro)[0][0]  # one rank: the whole global batches
    assert len(reference) == 2 * (N // G)
    for position, whole in enumerate(reference):
        for j, micro_rows in enumerate(whole):  # each micro-batch: the ranks' parts joined
            joined = [r for d in range(ranks) for r in by_data_rank[d][position][j]]
            assert joined == micro_rows
    for epoch in range(2):
        taken = [r for whole in reference[epoch * 4:(epoch + 1) * 4] for m in whole for r in m]
        assert len(taken) == len(set(taken)) == N - N % G  # each row at most once an epoch
    first, second = ([r for w in reference[e * 4:(e + 1) * 4] for m in w for r in m]
                     for e in range(2))
    assert first != second and sorted(first) != list(range(N - N % G))  # shuffled, per epoch


def test_an_unshuffled_loader_takes_the_rows_in_order():
    loader = shard.DataLoader(np.arange(30), 10, shuffle=False, prefetch=0)
    assert [b.tolist() for b in loader] == [list(range(0, 10)), list(range(10, 20)),
                                            list(range(20, 30))]
    assert loader.position == 3 and loader.epoch == 1 and len(loader) == 3


def train(comm, steps, *, loader_position=None, path=None, save_at=None, stage=2):
    """zero{stage} on the loader's batches: this rank's params whole at the end,
    its losses, and the global rows of each step (gathered)."""
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((N, 7)).astype(np.float32),
            "y": rng.standard_normal((N, 3)).astype(np.float32), "id": np.arange(N)}
    zero = (shard.zero1, shard.zero2, shard.zero3)[stage - 1]
    step = zero(lambda p, b: M.loss(p, b), optimizer=ops.adamw(M.LR, weight_decay=M.WD),
                comm=comm, options=shard.ZeroOptions(gradient_accumulation_steps=2))
    loader = shard.DataLoader(data, 2 * G, comm=comm, gradient_accumulation_steps=2, seed=7)
    if loader_position is None:
        state = step.init(M.init_params())
    else:
        state, _ = shard.load(path, step, comm=comm)
        loader.resume(state)
    losses, rows = [], []
    while int(state.batches) < steps:
        for batch in loader:
            if int(state.batches) == save_at:
                shard.save(state, path, comm=comm)
            ids = [np.asarray(m.pop("id")) for m in batch]
            rows.append(sorted(np.concatenate(
                [ops.all_gather(comm, i) for i in ids]).tolist()))
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
            if int(state.batches) == steps:
                break
    return shard.gather(state, comm), losses, rows, int(state.batches)


def test_a_run_resumed_mid_epoch_at_another_world_size_sees_the_same_batches(tmp_path):
    """Global batches of 24 in 2 micro-batches (2 batches a epoch): saved after 3
    steps at 2 ranks (mid-epoch), resumed at 3 and at 4 ranks, to step 7: the
    same global rows every step as the run never interrupted, and the same
    params (to the reduction order of the ranks)."""
    path = tmp_path / "ckpt"
    want, want_losses, want_rows, n = ops.spawn(
        lambda c: train(c, 7, path=path, save_at=3), 2)[0]
    assert n == 7 and len(want_rows) == 7
    for world in (3, 4):
        for got, losses, rows, n in ops.spawn(
                lambda c: train(c, 7, loader_position="saved", path=path), world):
            assert n == 7
            assert rows == want_rows[3:]
            np.testing.assert_allclose(losses, want_losses[3:], rtol=1e-5)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_skipped_update_still_takes_its_batch():
    """A step whose gradients are not finite leaves step where it was (clipping
    decides on the host) but counts its batch: the loader resumes after it."""
    def run(comm):
        step = shard.zero1(M.loss, optimizer=ops.adamw(M.LR), comm=comm, clip_norm=1.0)
        state = step.init(M.init_params())
        good, bad = M.batches(2, global_batch=4)
        bad["x"][0, 0] = np.inf
        state, metrics = step(state, bad)
        assert metrics["skipped"]
        state, _ = step(state, good)
        return int(state.step), int(state.batches)

    assert ops.spawn(run, 1) == [(1, 2)]


def test_a_torch_dataset_collates_torch_batches_and_micro_batches():
    xs = torch.arange(40.0).reshape(20, 2)
    data = torch.utils.data.TensorDataset(xs, torch.arange(20))

    def run(comm):
        loader = shard.DataLoader(data, 8, comm=comm, gradient_accumulation_steps=2,
                                  shuffle=False)
        batch = next(iter(loader))
        assert isinstance(batch, shard.MicroBatches) and len(batch) == 2
        return [(type(x).__name__, ids.tolist()) for x, ids in batch]

    got = ops.spawn(run, 2)
    assert got[0] == [("Tensor", [0, 1]), ("Tensor", [4, 5])]
    assert got[1] == [("Tensor", [2, 3]), ("Tensor", [6, 7])]


def test_samples_without_torch_tensors_are_stacked_and_a_collate_is_used_as_given():
    samples = [{"x": np.full(3, i, np.float32), "y": i} for i in range(12)]
    batch = next(iter(shard.DataLoader(samples, 4, shuffle=False)))
    np.testing.assert_array_equal(batch["y"], [0, 1, 2, 3])
    assert batch["x"].shape == (4, 3)
    joined = next(iter(shard.DataLoader(samples, 4, shuffle=False,
                                        collate=lambda s: [d["y"] for d in s])))
    assert joined == [0, 1, 2, 3]


def test_samples_on_a_device_are_stacked_there():
    """A dataset whose samples are CuPy arrays (the stand-in here) gives batches
    stacked on the device, never copied to the host implicitly."""
    from ops.testing import STANDIN, StandInArray

    rows = STANDIN.asarray(np.arange(16, dtype=np.float32).reshape(8, 2))

    class OnDevice:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"x": rows[i], "id": i}

    batch = next(iter(shard.DataLoader(OnDevice(), 4, shuffle=False)))
    assert isinstance(batch["x"], StandInArray) and batch["x"].shape == (4, 2)
    np.testing.assert_array_equal(STANDIN.to_host(batch["x"]),
                                  np.arange(8, dtype=np.float32).reshape(4, 2))
    np.testing.assert_array_equal(batch["id"], [0, 1, 2, 3])


def test_a_hugging_face_dataset_gives_its_columns_as_arrays_or_in_its_format():
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": np.arange(40.0).reshape(20, 2).tolist(),
                                        "id": list(range(20))})

    def run(comm):
        out = []
        for data in (table, table.with_format("torch")):
            batch = next(iter(shard.DataLoader(data, 8, comm=comm, seed=4)))
            out.append({k: (type(v).__name__, tuple(v.shape)) for k, v in batch.items()})
            np.testing.assert_array_equal(np.asarray(batch["x"])[:, 0],
                                          2.0 * np.asarray(batch["id"]))
            out.append(np.asarray(batch["id"]).tolist())
        return out

    ranks = ops.spawn(run, 2)
    for got in ranks:
        assert got[0] == {"x": ("ndarray", (4, 2)), "id": ("ndarray", (4,))}
        assert got[2] == {"x": ("Tensor", (4, 2)), "id": ("Tensor", (4,))}
        assert got[1] == got[3]  # the same rows in either format
    whole = shard.DataLoader(np.arange(20), 8, seed=4).rows(0)[0].tolist()
    assert ranks[0][1] + ranks[1][1] == whole  # the order of any data of 20 rows


class Failing:
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 25:
            raise KeyError(f"row {i} is broken")
        return np.float32(i)


def test_the_prefetch_thread_stops_when_iteration_stops_and_hands_over_errors():
    loader = shard.DataLoader(np.arange(100), 5, shuffle=False, prefetch=3)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert loader.position == 3
    assert not [t for t in threading.enumerate() if t.name == "shard.DataLoader"]
    assert next(iter(loader)).tolist() == [15, 16, 17, 18, 19]  # goes on where it stopped
    with pytest.raises(KeyError, match="row 25 is broken"):
        list(shard.DataLoader(Failing(), 5, shuffle=False))
    assert not [t for t in threading.enumerate() if t.name == "shard.DataLoader"]


def test_bad_arguments_are_refused_by_name():
    comm = ops.spawn(lambda c: c, 3)[0]
    with pytest.raises(ValueError, match=r"batch_size 8 does not split into "
                                         r"gradient_accumulation_steps 1 x 3 data rank"):
        shard.DataLoader(np.arange(20), 8, comm=comm)
    with pytest.raises(ValueError, match=r"leading dimensions differ \(\[4, 5\]\)"):
        shard.DataLoader({"x": np.zeros(4), "y": np.zeros(5)}, 2)
    with pytest.raises(ValueError, match="the data has 4 rows, fewer than one global batch"):
        shard.DataLoader(np.zeros(4), 8)
    with pytest.raises(TypeError, match="mesh= or comm=, not both"):
        shard.DataLoader(np.zeros(8), 4, comm=comm, mesh=comm)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        shard.DataLoader(np.zeros(8), 0)
    with pytest.raises(TypeError, match="resume: give a TrainState"):
        shard.DataLoader(np.zeros(8), 4).resume("start")
    with pytest.raises(TypeError, match="map-style dataset"):
        shard.DataLoader(object(), 4)
