"""A checkpoint as untrusted input (see [Note: untrusted checkpoints]): its manifest
checked field by field, and against the safetensors headers of its files, before
any rank file is opened for its data or anything is allocated."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from shard.checkpoint._files import CheckpointError

__all__ = ["check_manifest", "check_part_names", "optimizer_of", "plain_file"]

# [Note: untrusted checkpoints]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Checkpoints travel, so the loader trusts nothing in one. Loading runs no code
# (safetensors files, a JSON manifest; leaf paths are parsed as literals). And
# before a file's data is read or a buffer allocated, ``read_manifest`` checks:
#
# - every field's type and range (counts are integers >= 0, dtypes are the float
#   dtypes ZeRO trains, specs are Shard(0) or Replicate(), the loss scale is
#   finite and positive);
# - every file the manifest names is a plain name inside the checkpoint
#   directory (no separator, no "..", not absolute, not a symbolic link): a
#   manifest cannot reach outside its directory;
# - the layout the leaves describe is the one ``save`` writes: rows per rank from
#   the shape and the world size, offsets packed in leaf order within each unit,
#   the units' sizes their leaves' sums; so no edit moves a leaf onto another's
#   bytes;
# - each rank file's safetensors header holds every unit buffer the manifest
#   implies, with that size and dtype, within the file's bytes: what a load
#   allocates is bounded by what the files hold.
#
# Any failure is a CheckpointError naming the file and the field;
# ``python -m shard.checkpoint inspect`` reports the same. The SHA-256 of each
# file a load reads is compared as well, so a changed byte is refused too.

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")  # a manifest without "optimizer" (format 1's first)
REST_DTYPES = {"F32": "float32", "F64": "float64", "I32": "int32", "I64": "int64",
               "U32": "uint32", "BOOL": "bool"}
_MOMENT = re.compile(r"[A-Za-z0-9_]{1,64}(\.[A-Za-z0-9_]{1,64}){0,15}")
SPECS = ("Shard(0)", "Replicate()")
_ST_DTYPES = {"F32": "float32", "F64": "float64"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


def plain_file(name: object, where: str) -> str:
    """``name`` if it is a plain file name (inside the checkpoint directory)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\x00" in name or Path(name).is_absolute()):
        raise CheckpointError(f"{where}: {name!r} is not a plain file name inside the "
                              "checkpoint directory")
    return name


def check_part_names(index: Path, info: object) -> list[str]:
    """A pipeline checkpoint's ``pipeline.json``: its stage directories' names."""
    if not isinstance(info, dict) or not isinstance(info.get("parts"), list) or not info["parts"]:
        raise CheckpointError(f"{index}: parts must be a non-empty list of directory names")
    _int(info, "step", str(index))
    return [plain_file(d, f"{index}: parts") for d in info["parts"]]


def _int(obj: dict, key: str, where: str, lo: int = 0, hi: int | None = None) -> int:
    v = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise CheckpointError(f"{where}: {key} must be an integer {rng}; got {v!r}")
    return v


def _str(obj: dict, key: str, where: str, allowed: tuple[str, ...] | None = None) -> str:
    v = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(v, str) or (allowed is not None and v not in allowed):
        want = f"one of {list(allowed)}" if allowed else "a string"
        raise CheckpointError(f"{where}: {key} must be {want}; got {v!r}")
    return v


def _list(obj: dict, key: str, where: str) -> list:
    v = obj.get(key)
    if not isinstance(v, list):
        raise CheckpointError(f"{where}: {key} must be a list; got {type(v).__name__}")
    return v


def check_manifest(directory: Path, manifest: dict) -> None:
    """Refuse (CheckpointError) a manifest whose fields, layout or files do not
    hold together; see the Note."""
    where = f"{directory / 'manifest.json'}"
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{where}: version must be an integer >= 1; got {version!r}")
    _int(manifest, "step", where)
    _int(manifest, "good_steps", where)
    if "hysteresis" in manifest:  # written since DeepSpeed's hysteresis; older ones: the config's
        _int(manifest, "hysteresis", where, 1)
    if "batches" in manifest:  # written since shard.DataLoader; older ones: the step
        _int(manifest, "batches", where)
    skips = manifest.get("skips", {})
    if not isinstance(skips, dict) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in skips.values()):
        raise CheckpointError(f"{where}: skips must map leaf paths to integers >= 0; got "
                              f"{str(skips)[:200]}")
    scale = manifest.get("loss_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0):
        raise CheckpointError(f"{where}: loss_scale must be a finite number > 0; got {scale!r}")
    stage = _int(manifest, "stage", where, 0, 3)
    world = _int(manifest, "world_size", where, 1, 1 << 20)
    master = _str(manifest, "master_dtype", where, ("float32", "float64"))
    _str(manifest, "compute_dtype", where, FLOAT_DTYPES)
    units = _list(manifest, "units", where)
    sizes = []
    for u, unit in enumerate(units):
        at = f"{where}: units[{u}]"
        _str(unit, "name", at)
        sizes.append((_int(unit, "sharded_size", at), _int(unit, "replicated_size", at)))
    _check_leaves(where, _list(manifest, "leaves", where), sizes, world)
    moments, rest = optimizer_of(manifest, where)
    files = _list(manifest, "files", where)
    if len(files) != (1 if stage == 0 else world):
        raise CheckpointError(f"{where}: files lists {len(files)} rank files; a stage-{stage} "
                              f"checkpoint of {world} ranks has {1 if stage == 0 else world}")
    seen: set[str] = set()
    for r, entry in enumerate(files):
        at = f"{where}: files[{r}]"
        name = plain_file(entry.get("file") if isinstance(entry, dict) else None, f"{at}.file")
        if name in seen:
            raise CheckpointError(f"{at}.file: {name!r} is listed twice")
        seen.add(name)
        _file_entry(directory, entry, at)
        _check_header(directory / name, sizes, master, moments, rest)
    module = manifest.get("module")
    if module is not None:
        at = f"{where}: module"
        if not isinstance(module, dict):
            raise CheckpointError(f"{at} must be an object; got {type(module).__name__}")
        plain_file(module.get("file"), f"{at}.file")
        _file_entry(directory, module, at)
        buffers, aliases = module.get("buffers"), module.get("aliases")
        if not isinstance(buffers, list) or not all(isinstance(b, str) for b in buffers):
            raise CheckpointError(f"{at}.buffers must be a list of names")
        if not isinstance(aliases, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise CheckpointError(f"{at}.aliases must map names to names")
    _check_model_state(directory, manifest, where)


def _check_model_state(directory: Path, manifest: dict, where: str) -> None:
    """The manifest's ``model_state`` entry (see [Note: model state])."""
    entry = manifest.get("model_state")
    if entry is None:
        return
    at = f"{where}: model_state"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{at} must be an object; got {type(entry).__name__}")
    plain_file(entry.get("file"), f"{at}.file")
    _file_entry(directory, entry, at)
    leaves = entry.get("leaves")
    if not isinstance(leaves, list) or len(leaves) > 1 << 16 or not all(
            isinstance(x, str) and len(x) < 4096 for x in leaves):
        raise CheckpointError(f"{at}.leaves must be a list of key paths")


def optimizer_of(manifest: dict, where: str) -> tuple[tuple[str, ...], list[tuple]]:
    """The optimizer state a checkpoint holds: its moments' names, and the shape
    and dtype of each other leaf (``opt_rest/<i>``); Adam's where not said."""
    opt = manifest.get("optimizer")
    if opt is None:
        return ADAM_MOMENTS, []
    at = f"{where}: optimizer"
    if not isinstance(opt, dict):
        raise CheckpointError(f"{at} must be an object; got {type(opt).__name__}")
    moments = _list(opt, "moments", at)
    if len(moments) > 64 or not all(isinstance(m, str) and _MOMENT.fullmatch(m)
                                    and m != "master" for m in moments) \
            or len(set(moments)) != len(moments):
        raise CheckpointError(f"{at}.moments must be distinct dotted names; got {moments!r}")
    rest = []
    for i, entry in enumerate(_list(opt, "rest", at)):
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or len(shape) > 8 or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 31
                for d in shape):
            raise CheckpointError(f"{at}.rest[{i}].shape must be a list of integers >= 0; "
                                  f"got {shape!r}")
        rest.append((tuple(shape), _str(entry, "dtype", f"{at}.rest[{i}]",
                                        tuple(REST_DTYPES.values()))))
    return tuple(moments), rest


def _file_entry(directory: Path, entry: dict, at: str) -> None:
    sha = entry.get("sha256")
    if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
        raise CheckpointError(f"{at}.sha256 must be 64 hexadecimal digits; got {sha!r}")
    size = _int(entry, "bytes", at)
    f = directory / entry["file"]
    if f.is_symlink():
        raise CheckpointError(f"{f}: a symbolic link; a checkpoint's files are its own")
    if not f.is_file():
        raise CheckpointError(f"{f}: missing shard file")
    if f.stat().st_size != size:
        raise CheckpointError(f"{f}: truncated or altered ({f.stat().st_size} bytes, the "
                              f"manifest says {size})")


def _check_leaves(where: str, leaves: list, sizes: list[tuple[int, int]], world: int) -> None:
    """Each leaf's fields, and the layout they describe: the one ``save`` writes."""
    paths: set[str] = set()
    names: set[str] = set()
    placed: list[list[tuple[int, int, int]]] = [[] for _ in sizes]  # (section, offset, size)
    for i, leaf in enumerate(leaves):
        at = f"{where}: leaves[{i}]"
        if not isinstance(leaf, dict):
            raise CheckpointError(f"{at} must be an object; got {type(leaf).__name__}")
        for key, seen in (("path", paths), ("name", names)):
            v = _str(leaf, key, at)
            if v in seen:
                raise CheckpointError(f"{at}.{key}: {v!r} names two leaves")
            seen.add(v)
        shape = leaf.get("shape")
        if not isinstance(shape, list) or len(shape) > 32 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{at}.shape must be a list of integers >= 0; got {shape!r}")
        _str(leaf, "dtype", at, FLOAT_DTYPES)
        sharded = _str(leaf, "spec", at, SPECS) == "Shard(0)"
        if sharded and not shape:
            raise CheckpointError(f"{at}.spec: Shard(0) needs a dimension; the leaf is a scalar")
        u = _int(leaf, "unit", at, 0, len(sizes) - 1)
        rows = shape[0] if shape else 1
        row_size = math.prod(shape[1:]) if shape else 1
        rpr = _int(leaf, "rows_per_rank", at)
        want_rpr = -(-rows // world) if sharded else rows
        if rpr != want_rpr:
            raise CheckpointError(f"{at}.rows_per_rank is {rpr}; {shape} "
                                  f"{'split over' if sharded else 'whole on each of'} {world} "
                                  f"ranks gives {want_rpr}")
        offset = _int(leaf, "offset", at)
        placed[u].append((0 if sharded else 1, offset, rpr * row_size))
    for u, (section_sizes, leaves_of) in enumerate(zip(sizes, placed, strict=True)):
        for section in (0, 1):
            pos = section_sizes[0] if section else 0  # where the section's leaves start
            for sec, offset, size in leaves_of:
                if sec != section:
                    continue
                if offset != pos:
                    raise CheckpointError(f"{where}: unit {u}'s leaves are not packed as saved "
                                          f"(a leaf at offset {offset}, expected {pos})")
                pos += size
            end = section_sizes[0] + (section_sizes[1] if section else 0)
            if pos != end:
                raise CheckpointError(f"{where}: units[{u}].{('sharded', 'replicated')[section]}"
                                      f"_size is {section_sizes[section]}; its leaves hold "
                                      f"{pos - (section_sizes[0] if section else 0)}")


def _check_header(f: Path, sizes: list[tuple[int, int]], master: str,
                  moments: tuple[str, ...], rest: list[tuple]) -> None:
    """The rank file's safetensors header holds each unit buffer the manifest
    implies (``master/<u>`` and each moment's, ``exp_avg/<u>``...) and the
    optimizer's other leaves (``opt_rest/<i>``), in bounds."""
    total = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > min(_MAX_HEADER, total - 8):
                raise CheckpointError(f"{f}: a safetensors header of {n} bytes in a file of "
                                      f"{total}")
            header = json.loads(fh.read(n))
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: not a safetensors file (its header is not an object)")
    data = total - 8 - n
    itemsize = 4 if master == "float32" else 8
    wanted = [(f"{kind}/{u}", master, [a + b], (a + b) * itemsize, f"unit {u}")
              for kind in ("master", *moments) for u, (a, b) in enumerate(sizes)]
    wanted += [(f"opt_rest/{i}", dtype, list(shape),
                math.prod(shape) * np.dtype(dtype).itemsize,
                "optimizer state") for i, (shape, dtype) in enumerate(rest)]
    for key, dtype, shape, nbytes, what in wanted:
        t = header.get(key)
        if not isinstance(t, dict):
            raise CheckpointError(f"{f}: no tensor {key!r}, which the manifest's {what} needs")
        offsets = t.get("data_offsets")
        ok = ({**_ST_DTYPES, **REST_DTYPES}.get(str(t.get("dtype"))) == dtype
              and t.get("shape") == shape and isinstance(offsets, list) and len(offsets) == 2
              and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
              and 0 <= offsets[0] and offsets[1] - offsets[0] == nbytes and offsets[1] <= data)
        if not ok:
            raise CheckpointError(f"{f}: tensor {key!r} is {t.get('dtype')} {t.get('shape')} "
                                  f"at {offsets}; the manifest says {dtype} {shape} within the "
                                  f"file's {data} data bytes")
