"""Hosts for real: torchrun on each of two network namespaces (see
``tests/netns.py``), 2 processes each, or of four behind a switch, rendezvous
over c10d, gloo traffic over the links between them; the run matches the same
4 ranks on one host."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import netns
from tests.elastic_worker import uninterrupted
from tests.multiproc import ROOT, free_port

WHY = netns.unavailable()
STEPS = 4


def torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "--max-restarts", "0",
            str(ROOT / "tests" / "netns_worker.py")]


def environ(out: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "ZS_OUT": str(out), "ZS_STEPS": str(STEPS), "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1", **more}


def finish(procs: list[subprocess.Popen], timeout: float = 400) -> None:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]


def two_hosts(out: Path, **more: str) -> list[int]:
    """``examples/gpt.py``'s GPT on 2 namespaces x 2 processes; the bytes each host
    sent over its link."""
    return on_hosts(2, 2, out, **more)


def on_hosts(n: int, per_host: int, out: Path, **more: str) -> list[int]:
    """``examples/gpt.py``'s GPT on ``n`` namespaces x ``per_host`` processes; the
    bytes each host sent over its link."""
    with netns.hosts(n) as hosts:
        port = free_port()
        procs = []
        for i, h in enumerate(hosts):  # host 0 holds the rendezvous store
            args = ["--nnodes", str(n), "--nproc-per-node", str(per_host), "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint", f"{hosts[0].addr}:{port}", "--rdzv-id", "zs-two-hosts",
                    "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=120",
                    "--local-addr", h.addr]
            procs.append(subprocess.Popen(
                h.command(torchrun(args)), cwd=ROOT, text=True,
                env=environ(out, GLOO_SOCKET_IFNAME=h.ifname, **more), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT))
        finish(procs)
        return [h.tx_bytes() for h in hosts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training on one host (4 thread ranks: the same bits as 4
    processes), on two hosts, and on two hosts with hierarchical ZeRO (ZeRO-3
    inside each host, replicas across)."""
    import ops
    from examples import gpt
    from tests import netns_worker

    tmp = tmp_path_factory.mktemp("multinode")
    env = {"ZS_STEPS": str(STEPS)}
    model = gpt.build(netns_worker.config(env))
    one = ops.spawn(lambda comm: netns_worker.train_one(comm, env, model), 4)[0]
    # the three two-host runs in one launch, one after another in its process group;
    # each rank reads its host's link around each run
    modes = {"two-hosts": {}, "hsdp": {"ZS_REPLICAS": "2"}, "hpz": {"ZS_RESHARD": "2"}}
    two_hosts(tmp / "two-hosts.json", ZS_MODES=json.dumps(modes))
    reports = json.loads((tmp / "two-hosts.json").read_text())
    reports["one-host"] = one
    sent = {"flat" if k == "two-hosts" else k: reports[k]["sent"] for k in modes}
    return reports, sent


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_two_hosts_of_two_processes_train_as_four_ranks_on_one_host(runs):
    reports, sent = runs
    want, got = reports["one-host"], reports["two-hosts"]
    assert got["world"] == want["world"] == 4
    assert len(got["losses"]) == STEPS
    assert got["losses"] == want["losses"]  # the same trajectory, bit for bit
    for k, v in want["params"].items():
        np.testing.assert_allclose(got["params"][k], v, rtol=1e-6, err_msg=k)
    # each host holds half the shards, and a ZeRO-3 step gathers every unit twice
    # (forward, backward): each host receives at least the params' bytes per step
    assert min(sent["flat"]) >= STEPS * want["param_bytes"], (sent, want["param_bytes"])


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_hierarchical_zero_sends_only_gradient_shards_between_hosts(runs):
    """ZeRO-3 inside each host and replicas across (``replicate=``): the same
    training, and the link carries each host's gradient shards once per step
    (a 2-rank all-reduce of half the params per host), not the gathers."""
    reports, sent = runs
    want, got = reports["one-host"], reports["hsdp"]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    for k, v in want["params"].items():  # the sums' order differs: to each leaf's scale
        np.testing.assert_allclose(got["params"][k], v, rtol=1e-4,
                                   atol=1e-4 * np.abs(v).max(), err_msg=k)
    # analytic: each host's two ranks each all-reduce a shard of half the params with
    # their replica, sending about that shard's bytes: the params' bytes per host and
    # step, plus the step's small collectives
    for n in sent["hsdp"]:
        assert STEPS * want["param_bytes"] <= n <= 1.25 * STEPS * want["param_bytes"] + 2**18
    assert max(sent["hsdp"]) < 0.75 * min(sent["flat"]), sent
    per_step = {k: [round(n / STEPS / 2**20, 3) for n in v] for k, v in sent.items()}
    print(f"MiB sent per step by each rank's host: {per_step}; the params: "
          f"{want['param_bytes'] / 2**20:.3f} MiB")


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_four_hosts_through_a_switch_train_as_four_ranks_on_one_host(runs, tmp_path):
    """Four namespaces of one process each, linked through a bridge: every gather
    and reduce-scatter crosses a link, and the run is the one-host run."""
    reports, _ = runs
    want = reports["one-host"]
    sent = on_hosts(4, 1, tmp_path / "four.json")
    got = json.loads((tmp_path / "four.json").read_text())
    assert got["world"] == 4
    assert got["losses"] == want["losses"]
    assert got["params"] == want["params"]
    # each host sends its shard of every unit to the 3 others at each of a unit's two
    # gathers (3/4 of the params' bytes each) and 3 of its 4 gradient chunks (3/4):
    # 2.25x the params per step, and the step's small collectives and the rendezvous
    p = STEPS * want["param_bytes"]
    for n in sent:
        assert 2.25 * p <= n <= 1.25 * 2.25 * p + 2**18, (sent, p)
    print(f"four hosts: MiB sent per host and step: {[round(n / STEPS / 2**20, 3) for n in sent]}")


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_secondary_shards_gather_across_hosts_once_a_step(runs):
    """ZeRO-3 over all 4 ranks with ``reshard_after_forward=2`` (one secondary
    shard per host; see [Note: secondary shards]): bit for bit the flat run's
    trajectory, and the link carries each rank's shard of every unit once (to
    its counterpart on the other host, half the params per host) and the flat
    reduce-scatter's gradients (the params' bytes per host): 1.5x the params
    per host and step, where flat ZeRO-3 sends 3x."""
    reports, sent = runs
    want, got = reports["two-hosts"], reports["hpz"]
    assert got["losses"] == want["losses"]
    assert got["params"] == want["params"]
    p = STEPS * want["param_bytes"]
    for n in sent["hpz"]:
        assert 1.5 * p <= n <= 1.25 * 1.5 * p + 2**18, (sent, p)
    # the gathers' share, flat's sends less the reduce-scatter's (the params' bytes)
    # against hpZ's: at most 1/(ranks per host) of it
    for flat, hpz in zip(sent["flat"], sent["hpz"], strict=True):
        assert hpz - p <= (flat - p) / 2, sent


@pytest.mark.multiprocess
@pytest.mark.skipif(WHY is not None or shutil.which("tc") is None,
                    reason=WHY or "no tc here to shape the link")
def test_multinode_benchmark_prints_its_table():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multinode.py"), "--rounds",
                          "1", "--steps", "2", "--warmup", "2", "--d-model", "32", "--layers",
                          "2", "--modes",
                          "hsdp", "qwz", "hpz-qwz", "qgz", "hpz-qwz-qgz", "zero2-onebit",
                          "zero2-zeroone"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines()
            if line.startswith(("| flat", "| hsdp", "| hpz", "| qwz", "| qgz", "| zero2"))}
    assert set(rows) == {"flat", "hsdp", "qwz", "hpz-qwz", "qgz", "hpz-qwz-qgz",
                         "zero2-onebit", "zero2-zeroone"}, out.stdout
    ratio = {k: float(v.split("|")[5]) for k, v in rows.items()}  # bytes / params' bytes
    # the two gathers (2x the params, flat) at about a quarter: at least 1x less
    assert ratio["qwz"] < ratio["flat"] - 1, out.stdout
    # the gradients' reduce-scatter (1x) at about a quarter: at least half less
    assert ratio["qgz"] < ratio["flat"] - 0.5, out.stdout
    assert ratio["hsdp"] < ratio["hpz-qwz"] < ratio["qwz"], out.stdout
    # and inside hpZ's groups the gradients cross once, quantized: below HSDP's all-reduce
    assert ratio["hpz-qwz-qgz"] < min(ratio["hsdp"], ratio["hpz-qwz"] - 0.5), out.stdout
    # after the warm-up the 1-bit family sends its compressed all-reduces alone (and the
    # step's small all-reduce, whose headers weigh on a model this small): no params
    assert ratio["zero2-onebit"] < 0.5 and ratio["zero2-zeroone"] < 0.5, out.stdout
    assert "diverged" not in out.stdout, out.stdout


ELASTIC_STEPS, ELASTIC_EVERY = 9, 3


def elastic(out: Path, ckpt: Path, **more: str) -> dict[str, str]:
    """The environment of ``tests/elastic_worker.py``: 9 steps, a checkpoint every 3."""
    return environ(out, ZS_CKPT=str(ckpt), ZS_STEPS=str(ELASTIC_STEPS),
                   ZS_EVERY=str(ELASTIC_EVERY), ZS_KILL_RANK="0",
                   ZS_KILL_STEP="-1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **more)


def elastic_run(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "--max-restarts", "1",
            str(ROOT / "tests" / "elastic_worker.py")]


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_a_killed_host_rejoins_and_the_run_ends_bit_identical(tmp_path):
    """Two hosts under ``torchrun --max-restarts 1``: once the first checkpoint is
    on disk, every process of host 1 (its agent and workers) is SIGKILLed; host
    0's agent restarts its workers and waits at the rendezvous, a new agent on
    host 1 joins, and both resume from the checkpoint to params bit-identical
    to an uninterrupted run of 4 ranks (thread ranks: the same bits)."""
    out, ckpt, pause = tmp_path / "killed.json", tmp_path / "ckpt", tmp_path / "pause"
    pause.touch()  # a step after the checkpoint takes a second: time to kill a host mid-run
    with netns.two_hosts() as hosts:
        port = free_port()

        def agent(i: int) -> subprocess.Popen:
            h = hosts[i]
            args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{hosts[0].addr}:{port}", "--rdzv-id", "zs-killed-host",
                    # the killed agent leaves the rendezvous once its keep-alive has gone
                    # unanswered keep_alive_max_attempt times (5 s x 3 by default): 1 s x 3
                    "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=120,"
                    "keep_alive_interval=1,keep_alive_max_attempt=3",
                    "--local-addr", h.addr]
            return subprocess.Popen(h.command(elastic_run(args)), cwd=ROOT, text=True,
                                    env=elastic(out, ckpt, ZS_PAUSE=str(pause),
                                                GLOO_SOCKET_IFNAME=h.ifname),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        first = [agent(0), agent(1)]
        deadline = time.monotonic() + 300
        while not (ckpt / "manifest.json").exists():
            assert time.monotonic() < deadline and first[1].poll() is None, "no checkpoint"
            time.sleep(0.1)
        pids = subprocess.run(["ip", "netns", "pids", hosts[1].ns], capture_output=True,
                              text=True, check=True).stdout.split()
        for pid in pids:  # the whole host: its agent and its workers
            subprocess.run(["kill", "-9", pid], capture_output=True)
        first[1].communicate(timeout=60)
        assert first[1].returncode == -9 and len(pids) >= 3  # an agent and two workers
        pause.unlink()
        finish([first[0], agent(1)])
    got = json.loads(out.read_text())
    assert got["attempt"] == 1  # host 0's workers, restarted by their agent
    resumed = ELASTIC_EVERY  # the first checkpoint's step
    assert got["first"] == resumed and got["ran"] == list(range(resumed, ELASTIC_STEPS)), \
        got["ran"]
    assert got["params"] == uninterrupted(4, ELASTIC_STEPS)  # bit for bit
