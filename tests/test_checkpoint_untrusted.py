"""Checkpoints as untrusted input (see [Note: untrusted checkpoints]): a tampered
manifest or rank file is refused with a CheckpointError naming the file and the
field, before a file outside the checkpoint is opened or anything is allocated;
a fuzz test edits every field and byte at random and allows only that error or
a load equal to the untouched checkpoint's."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import ops
import shard
from shard.checkpoint import consolidate, inspect
from tests import zero_models as M

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

WORLD = 2


def _make(comm):
    return shard.zero3(M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm)


def _load(path, like=True):
    """Every rank's master and moment buffers after loading ``path``."""
    def run(comm):
        state, _ = shard.load(path, _make(comm), comm=comm,
                              like=M.init_params() if like else None)
        return [np.concatenate([np.asarray(b) for b in getattr(state, k)])
                for k in ("master", "exp_avg", "exp_avg_sq")]

    return ops.spawn(run, WORLD)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("untrusted") / "ckpt"

    def run(comm):
        step = _make(comm)
        state = step.init(M.init_params())
        for b in M.batches(2):
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=WORLD))
        shard.save(state, path, comm=comm, extra={"batch": 2})

    ops.spawn(run, WORLD)
    return path


@pytest.fixture(scope="module")
def untouched(saved):
    return _load(saved)


def _edited(saved, tmp_path, edit):
    path = shutil.copytree(saved, tmp_path / "edited")
    m = json.loads((path / "manifest.json").read_text())
    edit(m, path)
    (path / "manifest.json").write_text(json.dumps(m))
    return path


def _refused(path, match):
    with pytest.raises(shard.CheckpointError, match=match):
        _load(path)
    with pytest.raises(shard.CheckpointError, match=match):
        inspect(path)


def test_a_rank_file_outside_the_directory_is_refused_before_it_is_opened(saved, tmp_path,
                                                                             monkeypatch):
    def outside(m, path):
        shutil.copy(path / "rank-00001.safetensors", tmp_path / "outside.safetensors")
        m["files"][1]["file"] = "../outside.safetensors"

    _refused(_edited(saved, tmp_path, outside),
             r"files\[1\]\.file: '\.\./outside\.safetensors' is not a plain file name")
    absolute = _edited(saved, tmp_path / "b",
                       lambda m, p: m["files"][0].update(file="/etc/hostname"))
    opened = []
    real_stat = Path.stat

    def stat(self, *a, **k):
        opened.append(str(self))
        return real_stat(self, *a, **k)

    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(shard.CheckpointError, match=r"'/etc/hostname' is not a plain file"):
        inspect(absolute)
    assert not any("hostname" in f for f in opened)


def test_a_symbolic_link_among_the_files_is_refused(saved, tmp_path):
    def link(m, path):
        target = tmp_path / "elsewhere.safetensors"
        shutil.move(path / "rank-00000.safetensors", target)
        os.symlink(target, path / "rank-00000.safetensors")

    _refused(_edited(saved, tmp_path, link), "rank-00000.safetensors: a symbolic link")


@pytest.mark.parametrize("like", [True, False])
def test_a_huge_leaf_shape_is_refused_before_allocation(saved, tmp_path, like):
    """0.w is (7, 5): 4 rows per rank. A claimed 10^12 rows is refused at each
    level of consistency an editor may reach: rows per rank, the unit's
    packing, and the rank files' headers, which bound what a load allocates."""
    def leaf(m):
        i = next(i for i, e in enumerate(m["leaves"]) if e["name"] == "0.w")
        return i, m["leaves"][i]

    def huge(m, _):
        leaf(m)[1]["shape"] = [10**12, 3]

    with pytest.raises(shard.CheckpointError, match=r"leaves\[\d\]\.rows_per_rank is 4; "
                                                    r"\[1000000000000, 3\] split over 2"):
        _load(_edited(saved, tmp_path, huge), like=like)

    def rows_too(m, _):
        huge(m, _)
        leaf(m)[1]["rows_per_rank"] = 10**12 // 2

    with pytest.raises(shard.CheckpointError, match=r"not packed as saved|_size is"):
        _load(_edited(saved, tmp_path / "c", rows_too), like=like)

    def units_too(m, _):
        rows_too(m, _)
        i, e = leaf(m)
        u, grow = e["unit"], (10**12 // 2) * 3 - 4 * 5
        m["units"][u]["sharded_size"] += grow
        for j, other in enumerate(m["leaves"]):
            if other["unit"] == u and j != i and (other["spec"] == "Replicate()" or j > i):
                other["offset"] += grow

    with pytest.raises(shard.CheckpointError, match=r"tensor 'master/\d+' is F32 \[\d+\]"):
        _load(_edited(saved, tmp_path / "d", units_too), like=like)


def test_a_spec_other_than_shard_0_or_replicate_is_named(saved, tmp_path):
    _refused(_edited(saved, tmp_path, lambda m, _: m["leaves"][0].update(spec="Shard(9)")),
             r"leaves\[0\]: spec must be one of \['Shard\(0\)', 'Replicate\(\)'\]; got "
             r"'Shard\(9\)'")


def test_a_dtype_the_library_does_not_train_is_named(saved, tmp_path):
    _refused(_edited(saved, tmp_path, lambda m, _: m["leaves"][1].update(dtype="object")),
             r"leaves\[1\]: dtype must be one of .*got 'object'")


def test_a_leaf_moved_onto_another_leafs_bytes_is_refused(saved, tmp_path):
    def moved(m, _):
        m["leaves"][1]["offset"] += 2

    _refused(_edited(saved, tmp_path, moved), "not packed as saved")


def test_fields_the_loader_does_not_need_still_load_exactly(saved, tmp_path, untouched):
    def harmless(m, _):
        m["extra"] = {"note": [1, 2]}
        m["leaves"][0]["name"] = "renamed"
        m["units"][0]["name"] = "renamed"
        m["step"] = 7

    got = _load(_edited(saved, tmp_path, harmless))
    for r in range(WORLD):
        for a, b in zip(got[r], untouched[r], strict=True):
            np.testing.assert_array_equal(a, b)
    for field, value in (("world_size", 3), ("stage", 0), ("units", [])):
        path = _edited(saved, tmp_path / field, lambda m, _, f=field, v=value: m.update({f: v}))
        with pytest.raises(shard.CheckpointError):
            _load(path)


def test_consolidate_refuses_what_load_refuses(saved, tmp_path):
    path = _edited(saved, tmp_path, lambda m, _: m["leaves"][0].update(spec="Shard(9)"))
    with pytest.raises(shard.CheckpointError, match="spec must be one of"):
        consolidate(path, tmp_path / "out.safetensors")


# -- the fuzz test -----------------------------------------------------------------------

SPECIAL = ["../outside.safetensors", "/etc/hostname", "rank-00000.safetensors",
           "rank-00001.safetensors", "Shard(0)", "Shard(9)", "Replicate()", "object",
           "float16", "bfloat16", "float32", "float64", "", ".", "..", "a/b", "0" * 64]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 12), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(SPECIAL), st.lists(st.integers(-2, 10**13), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def _places(node, at=()):
    """Every key path in a JSON document (containers included)."""
    out = [at] if at else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _places(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _places(v, (*at, i))
    return out


@st.composite
def edits(draw, manifest, sizes):
    kind = draw(st.sampled_from(["set", "set", "nudge", "delete", "byte", "truncate"]))
    if kind in ("byte", "truncate"):
        f = draw(st.sampled_from(sorted(sizes)))
        return kind, f, draw(st.integers(0, sizes[f] - 1)), draw(st.integers(1, 255))
    place = draw(st.sampled_from(_places(manifest)))
    if kind == "nudge":
        return kind, place, draw(st.sampled_from([-1, 1, 2, 1000])), None
    return kind, place, (draw(VALUES) if kind == "set" else None), None


def _apply(path, edit):
    kind, where, value, extra = edit
    if kind == "byte":
        f = path / where
        data = bytearray(f.read_bytes())
        data[value] ^= extra
        f.write_bytes(bytes(data))
        return
    if kind == "truncate":
        f = path / where
        f.write_bytes(f.read_bytes()[:value])
        return
    m = json.loads((path / "manifest.json").read_text())
    node = m
    for k in where[:-1]:
        node = node[k]
    last = where[-1]
    if kind == "delete":
        del node[last]
    elif kind == "nudge":
        old = node[last]
        if isinstance(old, bool) or not isinstance(old, (int, float)):
            return
        node[last] = old + value
    else:
        node[last] = value
    (path / "manifest.json").write_text(json.dumps(m))


def test_fuzzed_checkpoints_load_exactly_or_raise_checkpoint_error(saved, untouched):
    manifest = json.loads((saved / "manifest.json").read_text())
    sizes = {f.name: f.stat().st_size for f in saved.iterdir()}
    outcomes = {"refused": 0, "loaded": 0}

    @hypothesis.settings(max_examples=int(os.environ.get("ZS_FUZZ_EXAMPLES", "200")),
                         deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(edits(manifest, sizes))
    def check(edit):
        with tempfile.TemporaryDirectory() as d:
            path = shutil.copytree(saved, Path(d) / "ckpt")
            _apply(path, edit)
            try:
                inspect(path)
            except shard.CheckpointError:
                pass
            try:
                got = _load(path)
            except shard.CheckpointError:
                outcomes["refused"] += 1
                return
            outcomes["loaded"] += 1
            for r in range(WORLD):
                for a, b in zip(got[r], untouched[r], strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=str(edit))

    check()
    assert outcomes["refused"] > 0 and outcomes["loaded"] > 0, outcomes
