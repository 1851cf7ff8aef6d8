"""The gloo backend with real processes (2, 3 and 4 ranks), and its failure modes (each
world size's launch ends with one of them: see ``tests.multiproc.LAST``)."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_matches_numpy(tmp_path, gloo_shared, world):
    reports = gloo_shared("collectives", world)
    for r, rep in enumerate(reports):
        assert rep.get("ok"), (r, rep)
        assert rep["failures"] == [], (r, rep["failures"])


@pytest.mark.multiprocess
def test_a_killed_process_fails_the_others_within_the_timeout(gloo_shared):
    reports = gloo_shared("kill", 3)  # after the collectives, on a group timing out at 20 s
    assert reports[1].get("missing"), "rank 1 was meant to die by SIGKILL"
    for r in (0, 2):
        rep = reports[r]
        assert not rep["ok"] and rep["running"] == "kill", rep
        assert rep["error"] in ("PeerFailed", "CollectiveTimeout", "CollectiveError"), rep
        assert f"all_gather on rank {r}" in rep["message"]
        assert rep["seconds"] < 25


@pytest.mark.multiprocess
def test_a_save_only_rank_0_calls_fails_every_rank_with_the_cause(tmp_path):
    reports = run_ranks("tests/gloo_worker.py", 2, tmp_path,
                        {"ZS_SCENARIO": "save0", "ZS_TIMEOUT": "4"})
    # each rank's wait ends at its timeout, or when the other, timed out, exits: whichever
    # comes first
    assert reports[0]["error"] in ("CollectiveTimeout", "PeerFailed"), reports[0]
    assert "save is a collective: every rank must call it" in reports[0]["message"]
    assert reports[1]["error"] in ("CollectiveTimeout", "PeerFailed"), reports[1]
    assert "reduce_scatter" in reports[1]["message"]  # in its step's reduction
    assert all(r["seconds"] < 30 for r in reports)


@pytest.mark.multiprocess
def test_point_to_point_and_split_across_four_processes(gloo_shared):
    reports = gloo_shared("p2p", 4)  # the four-process launch's last scenario
    for r, rep in enumerate(reports):
        assert rep.get("ok") or r == 0, rep
        assert rep["ring"] == (r - 1) % 4
        assert rep["data"] == ([0, 1] if r < 2 else [2, 3])
        assert rep["pipe"] == ([0, 2] if r % 2 == 0 else [1, 3])
        assert rep["mesh"] == [rep["data"], rep["pipe"]]  # shard.Mesh's axes on gloo
    assert reports[2]["pipe_recv"] == reports[3]["pipe_recv"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert reports[3]["preposted"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert "rank 0 sent 7 elements of float32 with tag 9" in reports[1]["mismatch"]
    # the refused payload is never taken: its sender fails (here when rank 1 exits)
    assert reports[0]["error"] in ("PeerFailed", "CollectiveTimeout"), reports[0]
    assert reports[0]["running"] == "p2p" and "send to rank 1" in reports[0]["message"]


@pytest.mark.multiprocess
def test_mismatched_sizes_across_processes_raise(gloo_shared):
    reports = gloo_shared("mismatch", 2)  # the two-process launch's last scenario
    for rep in reports:
        assert not rep.get("ok") and rep["running"] == "mismatch", rep
        assert "all_gather" in rep["message"], rep
