"""``tests.multiproc.launch``: a script's ranks forked from the fork server behave as
fresh processes do (see [Note: forked launches]): the same environment, argv,
working directory, JAX devices (XLA_FLAGS is read when the backend starts), exit
codes and output; a rank whose variables read at import differ from the server's
starts fresh; a rank that outlives the timeout is killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import multiproc

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax
    print(json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
                      "port": os.environ["MASTER_PORT"], "argv": sys.argv[1:],
                      "cwd": os.getcwd(), "devices": len(jax.devices()),
                      "mine": os.environ.get("ZS_MINE"), "omp": os.environ["OMP_NUM_THREADS"],
                      "parent": os.getppid()}))
    if os.environ.get("ZS_SLEEP"):
        import time
        time.sleep(float(os.environ["ZS_SLEEP"]))
    print("on stderr", file=sys.stderr)
    sys.exit(int(os.environ["RANK"]) + 3)
""")


def _run(tmp_path, fork: str, monkeypatch, **env: str) -> tuple[list[int], list[dict], list[str]]:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("ZS_FORK_LAUNCH", fork)
    codes, logs = multiproc.launch([sys.executable, str(script), "a", "b"], 2,
                                   {"XLA_FLAGS": "--xla_force_host_platform_device_count=3",
                                    "ZS_MINE": "x", **env}, timeout=120)
    return codes, [json.loads(log.splitlines()[0]) for log in logs], logs


@pytest.mark.multiprocess
def test_forked_ranks_run_a_script_as_fresh_processes_do(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the suite runs (make test's TEST_ENV)
    forked = _run(tmp_path, "1", monkeypatch)
    fresh = _run(tmp_path, "", monkeypatch)
    for codes, reports, logs in (forked, fresh):
        assert codes == [3, 4]
        assert [r["rank"] for r in reports] == ["0", "1"]
        assert all("on stderr" in log for log in logs)
        assert len({r["port"] for r in reports}) == 1
    drop = ("parent", "port")
    assert [{k: v for k, v in r.items() if k not in drop} for r in forked[1]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in fresh[1]]
    assert forked[1][0] == {**forked[1][0], "argv": ["a", "b"], "devices": 3, "mine": "x",
                            "cwd": str(multiproc.ROOT)}
    # the fork server's children are not this process's; fresh ones are
    assert all(r["parent"] != os.getpid() for r in forked[1])
    assert all(r["parent"] == os.getpid() for r in fresh[1])


@pytest.mark.multiprocess
def test_a_rank_whose_import_time_variables_differ_starts_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    codes, reports, _ = _run(tmp_path, "1", monkeypatch, OMP_NUM_THREADS="2")
    assert codes == [3, 4] and [r["omp"] for r in reports] == ["2", "2"]
    assert all(r["parent"] == os.getpid() for r in reports)


@pytest.mark.multiprocess
@pytest.mark.parametrize("fork", ["1", ""])
def test_ranks_past_the_timeout_are_killed(tmp_path, monkeypatch, fork):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("ZS_FORK_LAUNCH", fork)
    with pytest.raises(subprocess.TimeoutExpired):
        multiproc.launch([sys.executable, str(script)], 2, {"ZS_SLEEP": "600"}, timeout=3)
