"""examples/gpt.py: a run that saves and resumes equals one that never stopped, and
the command line trains, logs, checkpoints and samples."""

from __future__ import annotations

import csv

import numpy as np
import pytest

import ops
import shard
from examples import gpt

CFG = gpt.GPTConfig(seq=16, d=32, layers=1, heads=2)


def test_resuming_from_a_checkpoint_continues_the_same_run(tmp_path):
    model = gpt.build(CFG)

    def run(comm, steps, save=None, resume=False, stage=3):
        out = gpt.train(comm, stage=stage, steps=steps, batch=6, cfg=CFG, model=model,
                        progress=False, save=save, save_every=4, resume=resume)
        return shard.gather(out["state"], comm), out["first_step"]

    straight, _ = ops.spawn(lambda c: run(c, 9), 2)[0]
    ops.spawn(lambda c: run(c, 6, tmp_path), 2)  # saved at 4 and at 6
    resumed, first = ops.spawn(lambda c: run(c, 9, tmp_path, True, stage=2), 2)[0]
    assert first == 6  # the data stream continued at batch 6
    for k in straight:  # the same ranks' sums in the same order: the same bits
        np.testing.assert_array_equal(resumed[k], straight[k], err_msg=k)


def test_the_command_line_trains_saves_resumes_and_samples(tmp_path, capsys):
    args = ["--threads", "2", "--d-model", "32", "--layers", "1", "--batch", "4",
            "--save", str(tmp_path), "--save-every", "10", "--sample", "40"]
    gpt.main([*args, "--steps", "10"])
    gpt.main([*args, "--steps", "20", "--resume"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 10" in out
    assert out.count("sample:\ndef ") == 2
    assert [int(r["step"]) for r in csv.DictReader((tmp_path / "metrics.csv").open())] == [10, 20]
    assert (tmp_path / "checkpoint" / "manifest.json").exists()


def test_every_flag_reaches_the_script_through_torchrun_and_none_is_abbreviated():
    """torchrun matches abbreviations of its own flags after the script's name; the
    script's flags are full names, none a prefix of torchrun's, and abbreviating
    one is an error rather than a guess."""
    from torch.distributed.run import get_args_parser

    flags = [a for action in gpt.parser()._actions for a in action.option_strings
             if a.startswith("--") and a != "--help"]
    for flag in flags:
        args = get_args_parser().parse_args(["--nproc-per-node", "2", "examples/gpt.py",
                                             flag, "1"])
        assert args.training_script_args == [flag, "1"], flag
    with pytest.raises(SystemExit):
        gpt.main(["--d", "32", "--steps", "0"])

